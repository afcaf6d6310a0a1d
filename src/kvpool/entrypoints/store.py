"""``kvpool store master | node``: run the pool's processes (SIGINT/SIGTERM stop them cleanly)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable

from kvpool.common import auth
from kvpool.config import MasterConfig, NodeConfig, TransferConfig, from_wire
from kvpool.entrypoints import common

_DEFAULTS: dict[str, dict] = {}  # role -> {dest: default}, to tell given flags from defaults


def apply_config(args: argparse.Namespace, role: str) -> None:
    """Fill flags not given on the command line from ``--config FILE`` (YAML: a mapping of
    long flag names, e.g. ``memory: 2GiB``, ``high-watermark: 0.85``, ``etcd: 127.0.0.1:2379``)."""
    if args.config:
        common.apply_yaml(args, args.config, _DEFAULTS[role], f"kvpool store {role}")


def _configured(args: argparse.Namespace, role: str) -> bool:
    """``apply_config``, reporting a bad file on stderr (False: exit 2)."""
    try:
        apply_config(args, role)
        auth.export_cli_tokens(args)  # a token file named in --config
    except (OSError, ValueError) as exc:
        print(f"kvpool store {role}: {exc}", file=sys.stderr)
        return False
    return True


def _master(args: argparse.Namespace) -> int:
    from kvpool.common.log import setup_logging
    from kvpool.store.master.service import MasterService

    if not _configured(args, "master"):
        return 2
    setup_logging(args.log_level)
    config = MasterConfig(
        replicas=args.replicas,
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        lease_ttl=args.lease_ttl,
        node_ttl=args.node_ttl,
    )
    token, admin = auth.cluster_token() or "", auth.admin_token() or ""
    if args.etcd:
        return _master_ha(args, config, token, admin)
    service = MasterService(config, token=token, admin_token=admin)
    try:
        server = service.serve(args.host, args.port)
    except (ValueError, OSError) as exc:
        print(f"kvpool store master: {exc}", file=sys.stderr)
        service.close()
        return 1
    metrics = _master_metrics(args, lambda: service, lambda: server)
    ready = {"ready": True, "address": server.address, "metrics_port": _port(metrics)}
    common.announce_until_signal(ready)
    if metrics is not None:
        metrics.close()
    server.close()
    service.close()
    return 0


def _port(metrics) -> int | None:
    return None if metrics is None else metrics.port


def _master_metrics(
    args: argparse.Namespace,
    current: Callable[[], object | None],
    rpc_server: Callable[[], object | None],
):
    """``/metrics`` and ``/health`` of a master (``current()``: its service, None on standby)."""
    if args.metrics_port is None:
        return None
    from kvpool.store.metrics import MasterCollector, MetricsServer, RpcCollector

    def stats() -> dict:
        service = current()
        return service.stats() if service is not None else {}

    def health() -> dict:
        service = current()
        if service is None:
            return {"status": "standby"}
        return {"status": "ok", "role": "leader", **service.stats()}

    collectors = [MasterCollector(stats), RpcCollector(rpc_server)]
    return MetricsServer(collectors, health, "127.0.0.1", args.metrics_port)


def _master_ha(args: argparse.Namespace, config: MasterConfig, token: str, admin: str) -> int:
    """Campaign through etcd; serve only while leading (a fresh table, rebuilt from nodes)."""
    from kvpool.common.etcd import EtcdClient
    from kvpool.store.master.ha import LeaderElection
    from kvpool.store.master.service import MasterService

    address = f"{args.host}:{args.port}"
    live: dict = {}

    def elected() -> None:
        live["service"] = MasterService(config, rebuild_grace=args.rebuild_grace, token=token,
                                        admin_token=admin, commit_wait=args.commit_wait)  # fmt: skip
        live["server"] = live["service"].serve(args.host, args.port)
        print(json.dumps({"leader": True, "address": address}), flush=True)

    def lost() -> None:
        for key in ("server", "service"):
            obj = live.pop(key, None)
            if obj is not None:
                obj.close()

    election = LeaderElection(EtcdClient(args.etcd), address, elected, lost, ttl=args.leader_ttl)
    metrics = _master_metrics(args, lambda: live.get("service"), lambda: live.get("server"))
    ready = {"ready": True, "address": address, "role": "candidate", "metrics_port": _port(metrics)}
    stop = common.stop_event()
    print(json.dumps(ready), flush=True)
    election.start()
    stop.wait()
    election.close()
    lost()
    if metrics is not None:
        metrics.close()
    return 0


def node_config(args: argparse.Namespace) -> NodeConfig:
    """The node's config: from ``--config-json``, else from its flags (and ``--config``)."""
    if args.config_json:
        return from_wire(NodeConfig, common.read_json(args.config_json), "--config-json")
    apply_config(args, "node")
    return NodeConfig(master=args.master or "", memory=args.memory, ssd_path=args.ssd_path,
                      ssd_size=args.ssd_size, node_id=args.node_id, host=args.host,
                      directory=args.directory, metrics_port=args.metrics_port,
                      log_level=args.log_level)  # fmt: skip


def _node(args: argparse.Namespace) -> int:
    from kvpool.common.errors import KVPoolError
    from kvpool.common.log import setup_logging
    from kvpool.store.node import StorageNode

    try:
        cfg = node_config(args)
        auth.export_cli_tokens(args)  # a token file named in --config
    except (OSError, ValueError) as exc:
        print(f"kvpool store node: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    if not cfg.master:
        print("kvpool store node: --master (or master: in --config) is required", file=sys.stderr)
        return 2
    node_id = cfg.node_id or f"{socket.gethostname()}-{os.getpid()}"
    try:
        transfer = TransferConfig(host=cfg.host, directory=cfg.directory)
        node = StorageNode(node_id, cfg.master, cfg.memory, transfer, ssd_path=cfg.ssd_path,
                           ssd_size=cfg.ssd_size)  # fmt: skip
    except (ValueError, OSError, KVPoolError) as exc:
        print(f"kvpool store node: {exc}", file=sys.stderr)
        return 1
    metrics = None
    if cfg.metrics_port is not None:
        from kvpool.store.metrics import MetricsServer, NodeCollector
        from kvpool.transfer.metrics import TransferStatsCollector

        collectors = [NodeCollector(node.stats), TransferStatsCollector(node.engine.stats.snapshot)]
        metrics = MetricsServer(
            collectors, lambda: {"status": "ok", **node.stats()}, "127.0.0.1", cfg.metrics_port
        )
    ready = {"ready": True, "node_id": node_id, "segment": node.segment_name,
             "rpc": node.rpc.address, "metrics_port": _port(metrics)}  # fmt: skip
    common.announce_until_signal(ready)
    if metrics is not None:
        metrics.close()
    node.close()
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("store", help="the distributed KV-cache pool")
    sub = p.add_subparsers(dest="store_command", metavar="ROLE", required=True)
    m = sub.add_parser("master", help="the metadata master")
    m.add_argument("--host", default="127.0.0.1")
    m.add_argument("--port", type=int, default=50051)
    m.add_argument("--replicas", type=int, default=1)
    m.add_argument("--high-watermark", type=float, default=0.9)
    m.add_argument("--low-watermark", type=float, default=0.8)
    m.add_argument("--lease-ttl", type=float, default=10.0)
    m.add_argument("--node-ttl", type=float, default=10.0)
    m.add_argument("--etcd", default=None, help="HOST:PORT[,...]: elect one leader among masters")
    m.add_argument("--leader-ttl", type=float, default=3.0, help="leader lease (seconds)")
    m.add_argument("--rebuild-grace", type=float, default=2.0,
                   help="after winning an election: seconds to wait for nodes to report")  # fmt: skip
    m.add_argument("--commit-wait", type=float, default=1.0,
                   help="with --etcd: a put is acknowledged once its nodes hold its index entry "
                        "(what a standby rebuilds from), waiting at most this long (0: at once; "
                        "the last puts before a leader dies may then be lost)")  # fmt: skip
    m.add_argument("--metrics-port", type=int, default=None, help="serve /metrics and /health")
    m.add_argument("--config", default=None, help="YAML file of these settings")
    m.add_argument("--log-level", default="info")
    auth.add_token_args(m, admin=True)
    m.set_defaults(func=_master)
    _DEFAULTS["master"] = common.flag_defaults(m)
    n = sub.add_parser("node", help="a storage node contributing memory")
    n.add_argument(
        "--master", default=None, help="HOST:PORT, or etcd://HOST:PORT to follow the leader"
    )
    n.add_argument("--memory", default="512MiB")
    n.add_argument("--ssd-path", default=None, help="directory of the SSD tier (off if unset)")
    n.add_argument("--ssd-size", default="0", help="SSD tier budget, e.g. 8GiB")
    n.add_argument("--node-id", default=None)
    n.add_argument("--host", default="127.0.0.1", help="where its transfer server binds")
    n.add_argument("--directory", default=None,
                   help="segment directory URL (default: the master's own, or with "
                        "--master etcd://... that etcd)")  # fmt: skip
    n.add_argument("--metrics-port", type=int, default=None, help="serve /metrics and /health")
    n.add_argument("--config", default=None, help="YAML file of these settings")
    n.add_argument("--log-level", default="info")
    n.add_argument("--config-json", default=None, metavar="FILE",
                   help="the whole NodeConfig as JSON (- reads stdin: how kvpool serve hands "
                        "its node its config); other flags are then ignored")  # fmt: skip
    auth.add_token_args(n)
    n.set_defaults(func=_node)
    _DEFAULTS["node"] = common.flag_defaults(n)

"""``kvpool worker``: one engine process of the disaggregated cluster (CLI code: prints are fine).

A worker serves the OpenAI API over HTTP (the decode side: the conductor relays its streams),
and a control API over the project's RPC (``WorkerControl``: status, prefill hand-off). With
``--store`` its engine loads prefix blocks from the pool and publishes the blocks it computes.
It prints one JSON line when ready (``{"ready": true, "id", "role", "http", "rpc", ...}``);
with ``--etcd`` it also registers under ``/kvpool/workers/<id>`` (a lease renewed while it runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys

from kvpool.common import auth
from kvpool.common.errors import KVPoolError
from kvpool.config import WorkerConfig, from_wire
from kvpool.entrypoints import common
from kvpool.protocol.cluster import ROLES, WORKERS_PREFIX


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="one engine process of the cluster")
    p.add_argument("--role", choices=ROLES, default="both")
    p.add_argument("--id", default=None, help="worker id (default: <role>-<pid>)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    p.add_argument("--rpc-port", type=int, default=0, help="control RPC port (0: a free one)")
    p.add_argument("--store", default=None,
                   help="store master HOST:PORT or etcd://HOST:PORT (none: local cache only)")  # fmt: skip
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"])
    p.add_argument("--directory", default=None,
                   help="segment directory of the pool: rpc://, http:// or etcd://HOST:PORT "
                        "(default: etcd://<--etcd> if given, else the store master's)")  # fmt: skip
    p.add_argument("--etcd", default=None, help="etcd endpoints to register in (HOST:PORT,...)")
    p.add_argument("--pool-timeout", type=float, default=3.0,
                   help="seconds a prefix load or a save may wait for the pool (an unreachable "
                        "master or node, a master fail-over) before the worker recomputes or "
                        "drops the save (default %(default)s)")  # fmt: skip
    p.add_argument("--kv-load", choices=["async", "sync"], default="async",
                   help="load pool prefixes in the background while other requests step "
                        "(async, default), or inside the engine step (sync: the old path)")  # fmt: skip
    p.add_argument("--fetch-policy", choices=["auto", "always"], default="auto",
                   help="auto: load a prefix only when that is predicted faster than "
                        "recomputing it (measured load cost against the engine's step-cost "
                        "model); always: load whatever the pool holds")  # fmt: skip
    p.add_argument("--core-ledger", default=None, metavar="PATH",
                   help="share this host's cores with the other workers that name the same "
                        "file (e.g. /dev/shm/kvpool-cores-mygroup): a step takes the cores of "
                        "the idle ones (kvpool serve does this for its own workers)")  # fmt: skip
    p.add_argument("--core-slot", type=int, default=0, metavar="N",
                   help="this worker's slot in --core-ledger, unique per worker (default 0)")  # fmt: skip
    p.add_argument("--core-slots", type=int, default=0, metavar="M",
                   help="the workers sharing --core-ledger: it is created with M slots over "
                        "this host's cores if it does not exist (0: it must exist)")  # fmt: skip
    common.add_engine_args(p)
    common.add_http_args(p)
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])  # fmt: skip
    p.add_argument("--config-json", default=None, metavar="FILE",
                   help="the whole WorkerConfig as JSON (- reads stdin: how kvpool serve hands "
                        "its workers their configs); other flags are then ignored")  # fmt: skip
    auth.add_token_args(p)
    p.set_defaults(func=run)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The worker's config: from ``--config-json``, else from its flags."""
    if args.config_json:
        return from_wire(WorkerConfig, common.read_json(args.config_json), "--config-json")
    engine = common.engine_config(args)
    return WorkerConfig(role=args.role, worker_id=args.id, host=args.host, port=args.port,
                        rpc_port=args.rpc_port, store=args.store, transport=args.transport,
                        directory=args.directory, etcd=args.etcd,
                        pool_timeout=args.pool_timeout, kv_load=args.kv_load,
                        fetch_policy=args.fetch_policy, log_level=args.log_level,
                        core_ledger=args.core_ledger, core_slot=args.core_slot,
                        core_slots=args.core_slots, engine=engine,
                        http=common.http_limits(args))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        config = worker_config(args)
    except (OSError, ValueError) as exc:
        print(f"kvpool worker: invalid configuration: {exc}", file=sys.stderr)
        return 2
    token = auth.cluster_token()
    if common.refuse_open_bind("worker", config.host, token):
        return 2
    from kvpool.common.log import setup_logging

    setup_logging(config.log_level)
    previous = common.sigterm_as_interrupt()
    parts: list = []
    try:
        asyncio.run(_main(config, token, parts))
    except KeyboardInterrupt:
        pass
    except KVPoolError as exc:
        print(f"kvpool worker: {exc}", file=sys.stderr)
        return 1
    finally:
        for close in reversed(parts):
            try:
                close()
            except Exception as exc:  # keep closing the rest
                print(f"kvpool worker: while stopping: {exc}", file=sys.stderr)
        signal.signal(signal.SIGTERM, previous)
    return 0


def _connector(cfg: WorkerConfig, token: str | None, parts: list):
    if not cfg.store:
        return None
    from kvpool.config import TransferConfig
    from kvpool.engine.connectors.store import StoreConnector
    from kvpool.store.client import StoreClient

    directory = cfg.directory or (f"etcd://{cfg.etcd}" if cfg.etcd else None)  # else the master's
    wait = cfg.pool_timeout
    # spin_us=0: a polling wait for a pool reply would take a core from the model's compute
    transfer = TransferConfig(host=cfg.host, transport=cfg.transport, directory=directory,
                              auth_token=token or "", connect_timeout=min(wait, 5.0),
                              request_timeout=wait, spin_us=0)  # fmt: skip
    # a load slower than recomputing is useless: fail fast, recompute, retry the pool later
    client = StoreClient(cfg.store, transfer, token=token or "", timeout=wait,
                         failover_timeout=wait)  # fmt: skip
    parts.append(client.close)
    return StoreConnector(client, async_load=cfg.kv_load == "async",
                          fetch_policy=cfg.fetch_policy == "auto")  # fmt: skip


async def _main(cfg: WorkerConfig, token: str | None, parts: list) -> None:
    from kvpool.common.rpc import RpcServer
    from kvpool.engine.async_engine import AsyncLLMEngine
    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.serving.api_server import build_app
    from kvpool.serving.http_limits import serve_http
    from kvpool.serving.worker_control import WorkerControl

    wid = cfg.worker_id or f"{cfg.role}-{os.getpid()}"
    name = cfg.engine.served_model_name or common.served_name_of(cfg.engine.model)
    connector = _connector(cfg, token, parts)
    engine = LLMEngine(cfg.engine, connector=connector)
    cores = None
    if cfg.core_ledger:
        from kvpool.engine.core_share import open_ledger

        try:
            cores = open_ledger(cfg.core_ledger, cfg.core_slot, cfg.engine.num_threads or 1,
                                cfg.core_slots)  # fmt: skip
        except (OSError, ValueError) as exc:
            raise KVPoolError(f"core ledger: {exc}") from exc
    aeng = AsyncLLMEngine(engine, cores).start()
    parts.append(aeng.shutdown)
    sock = socket.create_server((cfg.host, cfg.port), family=_family(cfg.host))
    http = f"{_url_host(cfg.host)}:{sock.getsockname()[1]}"
    info = {"id": wid, "role": cfg.role, "http": http, "rpc": "", "model": name,
            "pid": os.getpid()}  # fmt: skip
    control = WorkerControl(info, aeng, asyncio.get_running_loop(), connector)
    # prefill calls hold a pool thread until their KV is published: enough threads that
    # status polls never queue behind them
    rpc = RpcServer(control, cfg.host, cfg.rpc_port, token=token or "", workers=64).start()
    parts.append(rpc.close)
    info["rpc"] = rpc.address
    if cfg.etcd:
        from kvpool.common.etcd import EtcdClient, Registration

        reg = Registration(EtcdClient(cfg.etcd), WORKERS_PREFIX + wid.encode(),
                           json.dumps(info).encode())  # fmt: skip
        parts.append(reg.close)
    # the conductor relays with the internal bearer; clients of this worker use the API key
    keys = [k for k in (token and auth.internal_bearer(token), auth.api_key()) if k]
    internal = [auth.internal_bearer(token)] if token else []  # /internal/generate only
    app = build_app(aeng, name, api_keys=keys, limits=cfg.http, internal_keys=internal)
    ready = {"ready": True, **info, "store": cfg.store}
    await serve_http(app, cfg.http, cfg.log_level, lambda: print(json.dumps(ready), flush=True),
                     sockets=[sock])  # fmt: skip


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

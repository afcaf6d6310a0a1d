"""``kvpool transfer``: the metadata service, and a standalone segment peer.

``kvpool transfer metadata --port 7070`` serves the HTTP segment directory.
``kvpool transfer peer --segment NAME --size 64MiB --directory URL`` registers a segment and
serves it until stdin closes or SIGTERM; it prints one JSON line when ready and answers
commands on stdin (``fill SEED``, ``digest OFFSET LENGTH``, ``quit``): handy to probe a host's
transfer path, and what the tests and benchmarks use as a real peer process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys

import numpy as np

from kvpool.common.auth import add_token_args
from kvpool.config import TransferConfig, parse_size
from kvpool.entrypoints import common


def pattern(seed: int, size: int) -> np.ndarray:
    """Deterministic pseudo-random bytes (tests compare against the same call)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _metadata(args: argparse.Namespace) -> int:
    from kvpool.common.log import setup_logging
    from kvpool.transfer.metadata_server import MetadataServer

    setup_logging(args.log_level)
    try:
        server = MetadataServer(args.host, args.port)  # the token: from the environment
    except (ValueError, OSError) as exc:
        print(f"kvpool transfer metadata: {exc}", file=sys.stderr)
        return 1
    common.announce_until_signal({"ready": True, "url": server.url})
    server.close()
    return 0


def _peer(args: argparse.Namespace) -> int:
    from kvpool.common.errors import KVPoolError
    from kvpool.common.log import setup_logging
    from kvpool.transfer.engine import TransferEngine

    setup_logging(args.log_level)
    try:
        config = TransferConfig(host=args.host, port=args.port, directory=args.directory)
        engine = TransferEngine(config)
        seg = engine.register(args.segment, size=parse_size(args.size), shared=not args.no_shm)
    except (ValueError, OSError, KVPoolError) as exc:
        print(f"kvpool transfer peer: {exc}", file=sys.stderr)
        return 1
    if args.metrics_port is not None:
        _serve_metrics(engine, args.metrics_port)
    ready = {"ready": True, "segment": seg.name, "size": seg.size, "port": engine.port}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # before "ready": no kill race
    print(json.dumps(ready), flush=True)
    try:
        for line in sys.stdin:
            reply = _command(seg.array, line.split())
            if reply is None:
                break
            print(reply, flush=True)
    finally:
        engine.close()
    return 0


def _command(array: np.ndarray, words: list[str]) -> str | None:
    try:
        if not words or words[0] == "quit":
            return None
        if words[0] == "fill":
            array[:] = pattern(int(words[1]), len(array))
            return "ok"
        if words[0] == "digest":
            a, n = int(words[1]), int(words[2])
            if a < 0 or n < 0 or a + n > len(array):
                return "error: out of bounds"
            return hashlib.blake2b(array[a : a + n].tobytes(), digest_size=16).hexdigest()
    except (IndexError, ValueError) as exc:
        return f"error: {exc}"
    return f"error: unknown command {words[0]!r}"


def _serve_metrics(engine, port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    from kvpool.transfer.metrics import TransferStatsCollector

    registry = CollectorRegistry()
    registry.register(TransferStatsCollector(engine.stats.snapshot))
    start_http_server(port, addr="127.0.0.1", registry=registry)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transfer", help="transfer engine tools")
    sub = p.add_subparsers(dest="transfer_command", metavar="TOOL", required=True)
    m = sub.add_parser("metadata", help="serve the HTTP segment directory")
    m.add_argument("--host", default="127.0.0.1")
    m.add_argument("--port", type=int, default=7070)
    m.add_argument("--log-level", default="info")
    add_token_args(m)
    m.set_defaults(func=_metadata)
    q = sub.add_parser("peer", help="register one segment and serve it")
    q.add_argument("--segment", required=True, help="cluster-wide segment name")
    q.add_argument("--size", default="64MiB")
    q.add_argument("--directory", default="memory", help="http://HOST:PORT or etcd://HOST:PORT")
    q.add_argument("--host", default="127.0.0.1")
    q.add_argument("--port", type=int, default=0)
    q.add_argument("--no-shm", action="store_true", help="plain memory: reachable over TCP only")
    q.add_argument("--metrics-port", type=int, default=None)
    q.add_argument("--log-level", default="warning")
    add_token_args(q)
    q.set_defaults(func=_peer)

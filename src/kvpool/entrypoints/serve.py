"""``kvpool serve``: the OpenAI-compatible server of one engine (CLI code: printing is fine)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from kvpool.common import auth
from kvpool.common.errors import KVPoolError
from kvpool.config import ClusterConfig
from kvpool.entrypoints.common import (
    AUTH_ENV,
    DEFAULT_SERVED_NAME,
    add_engine_args,
    add_http_args,
    apply_yaml,
    engine_config,
    flag_defaults,
    http_limits,
    refuse_open_bind,
    served_name,
    sigterm_as_interrupt,
)

_PARSER: list[argparse.ArgumentParser] = []


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="the embedded cluster (pool, prefill and decode workers, conductor), or one engine",
        description="With no flags: the pool, one prefill and one decode worker and the "
        "conductor on 127.0.0.1:8000. --single: one engine process serving the API itself.",
    )
    _PARSER.append(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"address to bind (non-loopback needs ${AUTH_ENV}; default %(default)s)",
    )
    p.add_argument("--port", type=int, default=8000, help="default %(default)s")
    add_engine_args(p)
    c = p.add_argument_group("cluster (ignored with --single)")
    c.add_argument("--single", action="store_true", help="one engine, no pool, no conductor")
    c.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    c.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    c.add_argument("--colocated", type=int, default=0, metavar="N",
                   help="N workers each doing prefill and decode, local prefix caching only "
                        "(the baseline; no pool)")  # fmt: skip
    c.add_argument("--store-memory", default="1GiB", help="DRAM of the pool's node")
    c.add_argument("--decode-threads", type=int, default=None, metavar="N",
                   help="torch threads of each decode worker (default: the same share of the "
                        "cores as every worker; more than its share oversubscribes them)")  # fmt: skip
    c.add_argument("--no-share-cores", dest="share_cores", action="store_false",
                   help="keep each worker on its share of the cores (default: a worker steps "
                        "on the cores of the workers that are idle; off when --threads or "
                        "--decode-threads is given)")  # fmt: skip
    c.add_argument("--prefill-chunk", type=int, default=128, metavar="TOKENS",
                   help="prefill workers' tokens per step (default %(default)s; 0: "
                        "--max-num-batched-tokens): a chunk's KV is published to the pool "
                        "while the next chunk computes")  # fmt: skip
    c.add_argument("--decode-chunk", type=int, default=256, metavar="TOKENS",
                   help="decode workers' tokens per step, decode rows included (default "
                        "%(default)s; 0: --max-num-batched-tokens): bounds the gap a prompt "
                        "lent to a decode worker (--decode-prefill-gain) makes in its streams")  # fmt: skip
    c.add_argument("--config", default=None, help="YAML file of these flags (CLI wins)")
    from kvpool.entrypoints.conductor import add_conductor_args

    add_conductor_args(c)
    add_http_args(p)
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    auth.add_token_args(p)
    p.set_defaults(func=run)


def apply_config_file(args: argparse.Namespace) -> None:
    """Fill flags left at their defaults from ``--config`` (keys as flag names, - or _)."""
    apply_yaml(args, args.config, flag_defaults(_PARSER[0]), "kvpool serve")


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The embedded cluster's config from the flags (``ValueError`` for bad values)."""
    from kvpool.entrypoints.conductor import conductor_config

    return ClusterConfig(prefill=args.prefill, decode=args.decode, colocated=args.colocated,
                         store_memory=args.store_memory, prefill_chunk=args.prefill_chunk,
                         decode_chunk=args.decode_chunk,
                         decode_threads=args.decode_threads, share_cores=args.share_cores,
                         engine=engine_config(args), conductor=conductor_config(args, []))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine thread, serve HTTP until Ctrl-C or SIGTERM."""
    token = auth.cluster_token()
    if refuse_open_bind("serve", args.host, token):
        return 2
    from kvpool.common.log import setup_logging

    setup_logging(args.log_level)
    if not args.single:
        return _run_cluster(args, token)
    try:
        config, limits = engine_config(args), http_limits(args)
    except ValueError as exc:
        print(f"kvpool serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    # SIGTERM ends like Ctrl-C (uvicorn re-raises it after its graceful shutdown)
    previous = sigterm_as_interrupt()
    aeng = None
    try:
        aeng = _start_engine(config)
        from kvpool.serving.api_server import build_app

        key = auth.api_key()
        app = build_app(aeng, served_name(args), api_keys=[key] if key else [], limits=limits)
        asyncio.run(_serve(app, args, limits, auth=key is not None))
    except KeyboardInterrupt:
        print("kvpool serve: interrupted, shutting down", flush=True)
    except KVPoolError as exc:  # e.g. the model cannot be found or loaded
        print(f"kvpool serve: {exc}", file=sys.stderr)
        return 1
    finally:
        if aeng is not None:
            aeng.shutdown()
        signal.signal(signal.SIGTERM, previous)
        print("kvpool serve: stopped", flush=True)
    return 0


def _run_cluster(args: argparse.Namespace, token: str | None) -> int:
    try:
        if args.config:
            apply_config_file(args)
        cluster = cluster_config(args)
    except (OSError, ValueError) as exc:
        print(f"kvpool serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    from kvpool.entrypoints.launcher import launch

    previous = sigterm_as_interrupt()
    try:
        return launch(cluster, token)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start_engine(config):
    from kvpool.engine.async_engine import AsyncLLMEngine
    from kvpool.engine.llm_engine import LLMEngine

    print(
        f"kvpool serve: loading {config.model or DEFAULT_SERVED_NAME} ({config.dtype}, "
        f"KV cache {config.kv_cache_memory_bytes / 2**30:.2f} GiB)",
        flush=True,
    )
    engine = LLMEngine(config)
    print(
        f"kvpool serve: model {engine.model_config.name} loaded, "
        f"{engine.pool.num_blocks} KV blocks x {engine.block_size} tokens, "
        f"max_model_len {engine.max_model_len}",
        flush=True,
    )
    return AsyncLLMEngine(engine).start()


async def _serve(app, args: argparse.Namespace, limits, auth: bool) -> None:
    from kvpool.serving.http_limits import serve_http

    def ready() -> None:
        host = f"[{args.host}]" if ":" in args.host else args.host
        note = " (bearer token required)" if auth else ""
        print(f"kvpool serve: ready on http://{host}:{args.port}/v1{note}", flush=True)

    await serve_http(app, limits, args.log_level, ready, host=args.host,
                     port=args.port)  # fmt: skip

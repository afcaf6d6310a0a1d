"""``kvpool serve``: the OpenAI-compatible server of one engine (CLI code: printing is fine)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from kvpool.common import auth
from kvpool.common.errors import KVPoolError
from kvpool.common.net import is_loopback

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
AUTH_ENV = auth.AUTH_ENV


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
    c.add_argument("--prefill-chunk", type=int, default=128, metavar="TOKENS",
                   help="prefill workers' tokens per step (default %(default)s; 0: "
                        "--max-num-batched-tokens): a chunk's KV is published to the pool "
                        "while the next chunk computes")  # fmt: skip
    c.add_argument("--config", default=None, help="YAML file of these flags (CLI wins)")
    from kvpool.conductor.cli import add_conductor_args

    add_conductor_args(c)
    add_http_args(p)
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    auth.add_token_args(p)
    p.set_defaults(func=run)


def add_http_args(p: argparse.ArgumentParser) -> None:
    """Limits of the OpenAI HTTP front (shared by ``serve``, ``worker`` and ``conductor``)."""
    from kvpool.serving.http_limits import HttpLimits

    d = HttpLimits()
    g = p.add_argument_group("HTTP limits")
    g.add_argument("--max-body-bytes", default=str(d.max_body_bytes),
                   help="largest request body (default %(default)s bytes; 413 above)")  # fmt: skip
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections and requests at once (503 above; default %(default)s)")  # fmt: skip
    g.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a connection may take to send its request headers "
                        "(default %(default)s)")  # fmt: skip
    g.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds a request may take to send its body (default %(default)s)")  # fmt: skip


def http_limits(args: argparse.Namespace):
    from kvpool.serving.http_limits import HttpLimits

    return HttpLimits(args.max_body_bytes, args.max_connections, args.header_timeout,
                      args.body_timeout)  # fmt: skip


def apply_config_file(args: argparse.Namespace) -> None:
    """Fill flags left at their defaults from ``--config`` (keys as flag names, - or _)."""
    import yaml

    with open(args.config) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{args.config}: expected a mapping of flag names to values")
    parser = _PARSER[0]
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if not hasattr(args, dest) or dest in ("config", "func"):
            raise ValueError(f"{args.config}: unknown setting {key!r}")
        if getattr(args, dest) == parser.get_default(dest):
            setattr(args, dest, value)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (shared by ``serve`` and ``worker``)."""
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV cache size, e.g. 512MiB, 1GiB")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help=f"model name of the API (default: {DEFAULT_SERVED_NAME} or the folder name)",
    )


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_SERVED_NAME
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else (path.name or args.model)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine thread, serve HTTP until Ctrl-C or SIGTERM."""
    token = auth.cluster_token()
    if not is_loopback(args.host) and token is None:
        print(
            f"kvpool serve: refusing to bind {args.host} (not loopback) without an auth "
            f"token; set {AUTH_ENV}=<secret> or --auth-token-file (clients then send "
            "'Authorization: Bearer <secret>', or $KVPOOL_API_KEY's key) or bind 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    from kvpool.common.log import setup_logging

    setup_logging(args.log_level)
    try:
        http_limits(args)
    except ValueError as exc:
        print(f"kvpool serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if not args.single:
        return _run_cluster(args, token)
    config = _engine_config(args)
    if config is None:
        return 2
    # SIGTERM ends like Ctrl-C (uvicorn re-raises it after its graceful shutdown)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    aeng = None
    try:
        aeng = _start_engine(config)
        from kvpool.serving.api_server import build_app

        key = auth.api_key()
        app = build_app(aeng, served_name(args), api_keys=[key] if key else [],
                        limits=http_limits(args))  # fmt: skip
        asyncio.run(_serve(app, args, auth=key is not None))
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
        if args.colocated < 0 or args.prefill < 0 or args.decode < 0:
            raise ValueError("worker counts must be >= 0")
        if not args.colocated and (args.prefill + args.decode) < 1:
            raise ValueError("start at least one worker")
    except (OSError, ValueError) as exc:
        print(f"kvpool serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if _engine_config(args) is None:
        return 2
    from kvpool.serving.launcher import launch

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return launch(args, token)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _engine_config(args: argparse.Namespace):
    from kvpool.config import EngineConfig

    try:
        return EngineConfig(
            model=args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
            served_model_name=served_name(args),
            num_threads=args.threads,
        )
    except ValueError as exc:
        print(f"kvpool serve: invalid configuration: {exc}", file=sys.stderr)
        return None


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


async def _serve(app, args: argparse.Namespace, auth: bool) -> None:
    from kvpool.serving.http_limits import serve_http

    def ready() -> None:
        host = f"[{args.host}]" if ":" in args.host else args.host
        note = " (bearer token required)" if auth else ""
        print(f"kvpool serve: ready on http://{host}:{args.port}/v1{note}", flush=True)

    await serve_http(app, http_limits(args), args.log_level, ready, host=args.host,
                     port=args.port)  # fmt: skip

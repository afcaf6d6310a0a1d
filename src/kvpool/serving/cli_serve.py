"""``kvpool serve``: the OpenAI-compatible server of one engine (CLI code: printing is fine)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from kvpool.common.errors import KVPoolError
from kvpool.common.net import is_loopback

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
AUTH_ENV = "KVPOOL_AUTH_TOKEN"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve one engine over the OpenAI API (HTTP)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"address to bind (non-loopback needs ${AUTH_ENV}; default %(default)s)",
    )
    p.add_argument("--port", type=int, default=8000, help="default %(default)s")
    add_engine_args(p)
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    p.set_defaults(func=run)


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
    token = os.environ.get(AUTH_ENV) or None
    if not is_loopback(args.host) and token is None:
        print(
            f"kvpool serve: refusing to bind {args.host} (not loopback) without an auth "
            f"token; set {AUTH_ENV}=<secret> (clients then send 'Authorization: Bearer "
            "<secret>') or bind 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    from kvpool.common.log import setup_logging

    setup_logging(args.log_level)
    config = _engine_config(args)
    if config is None:
        return 2
    # SIGTERM ends like Ctrl-C (uvicorn re-raises it after its graceful shutdown)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    aeng = None
    try:
        aeng = _start_engine(config)
        from kvpool.serving.api_server import build_app

        app = build_app(aeng, served_name(args), api_key=token)
        asyncio.run(_serve(app, args, auth=token is not None))
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
    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host = f"[{args.host}]" if ":" in args.host else args.host
        note = " (bearer token required)" if auth else ""
        print(f"kvpool serve: ready on http://{host}:{args.port}/v1{note}", flush=True)
    await task

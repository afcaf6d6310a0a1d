"""What every entry point shares: the engine and HTTP flags, the refusal to bind a public
address without a token, SIGTERM as Ctrl-C, YAML files of flags, JSON configs, and flags to
config objects (CLI code)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from kvpool.common import auth
from kvpool.common.net import is_loopback

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
AUTH_ENV = auth.AUTH_ENV


def refuse_open_bind(prog: str, host: str, token: str | None) -> bool:
    """True (and a message) if ``host`` is not loopback and there is no cluster token."""
    if is_loopback(host) or token is not None:
        return False
    print(f"kvpool {prog}: refusing to bind {host} (not loopback) without an auth token; set "
          f"${AUTH_ENV}=<secret> or --auth-token-file (clients then send 'Authorization: "
          "Bearer <secret>', or $KVPOOL_API_KEY's key) or bind 127.0.0.1",
          file=sys.stderr)  # fmt: skip
    return True


def flag_defaults(parser: argparse.ArgumentParser) -> dict[str, object]:
    """{dest: default} of a parser's flags (what a YAML file of them may set)."""
    return {a.dest: a.default for a in parser._actions
            if a.dest not in ("help", "config", "config_json")}  # fmt: skip


def apply_yaml(args: argparse.Namespace, path: str, defaults: dict[str, object],
               what: str) -> None:  # fmt: skip
    """Fill the flags ``args`` left at their ``defaults`` (``flag_defaults``) from a YAML
    mapping of long flag names (``memory: 2GiB``, ``high-watermark: 0.85``; ``-`` or ``_``):
    the command line wins. ``ValueError`` for a key that is not one of ``what``'s flags."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values")
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in defaults:
            raise ValueError(f"{path}: unknown setting {key!r} for {what}")
        if getattr(args, dest) == defaults[dest]:
            setattr(args, dest, value)


def read_json(path: str):
    """A JSON document from ``path`` (``-``: stdin, which is then closed)."""
    import json

    if path == "-":
        text = sys.stdin.read()
        sys.stdin.close()
    else:
        with open(path) as f:
            text = f.read()
    return json.loads(text)


def stop_event():
    """An event set by SIGINT or SIGTERM; install it before saying "ready" (a signal right
    after the ready line must stop the process cleanly, not kill it)."""
    import threading

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    return done


def announce_until_signal(ready: dict) -> None:
    """Print the JSON ready line (what launchers and tests wait for), then block until SIGINT
    or SIGTERM."""
    import json

    done = stop_event()
    print(json.dumps(ready), flush=True)
    done.wait()


def sigterm_as_interrupt():
    """Make SIGTERM end like Ctrl-C; returns the previous handler (restore it after)."""
    return signal.signal(signal.SIGTERM, _interrupt)


def add_http_args(p: argparse.ArgumentParser) -> None:
    """Limits of the OpenAI HTTP front (shared by ``serve``, ``worker`` and ``conductor``)."""
    from kvpool.config import HttpLimits

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
    """The HTTP limits from their flags (``ValueError`` for bad values)."""
    from kvpool.config import HttpLimits

    return HttpLimits(args.max_body_bytes, args.max_connections, args.header_timeout,
                      args.body_timeout)  # fmt: skip


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (shared by ``serve`` and ``worker``)."""
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weights", default="auto", choices=["auto", "q4", "int8", "float32"],
                   help="linear layers' weights: the GGUF's 4-bit blocks, 8-bit blocks, or "
                        "float32 (exact); auto: what runs fastest here (default)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="KV blocks: the model's dtype (auto) or int8 with a scale per token "
                        "and head (0.27 of float32's bytes in memory, the pool and transfers)")  # fmt: skip
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
    return args.served_model_name or served_name_of(args.model)


def served_name_of(model: str | None) -> str:
    """The API's model name for a model path: the file's stem or the folder's name."""
    if model is None:
        return DEFAULT_SERVED_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else (path.name or model)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def engine_config(args: argparse.Namespace):
    """The engine's config from its flags (``ValueError`` for bad values)."""
    from kvpool.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, weights=args.weights,
                        kv_cache_dtype=args.kv_cache_dtype,
                        block_size=args.block_size,
                        kv_cache_memory_bytes=args.kv_cache_memory,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching,
                        served_model_name=served_name(args), num_threads=args.threads)  # fmt: skip

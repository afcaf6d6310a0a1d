"""The ``kvpool`` command: one subcommand per process kind (each body lives in its module)."""

from __future__ import annotations

import argparse
import sys

from kvpool import __version__
from kvpool.entrypoints import bench as bench_cli
from kvpool.entrypoints import conductor as conductor_cli
from kvpool.entrypoints import roofline as roofline_cli
from kvpool.entrypoints import serve as cli_serve
from kvpool.entrypoints import sim as sim_cli
from kvpool.entrypoints import store as store_cli
from kvpool.entrypoints import transfer as transfer_cli
from kvpool.entrypoints import worker as worker_cli


def _export_hf(args: argparse.Namespace) -> int:
    from kvpool.common.errors import KVPoolError
    from kvpool.common.log import setup_logging
    from kvpool.model.loader import export_hf

    setup_logging(args.log_level)
    try:
        out = export_hf(args.model, args.out)
    except KVPoolError as exc:
        print(f"kvpool export-hf: {exc}", file=sys.stderr)
        return 1
    print(f"kvpool export-hf: wrote {out}")
    return 0


def _add_export_hf(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export-hf", help="write a model as a Hugging Face folder")
    p.add_argument("--model", default=None, help="a .gguf file or folder (default: SmolLM2)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_export_hf)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    cli_serve.add_parser(subparsers)
    _add_export_hf(subparsers)
    transfer_cli.add_parser(subparsers)
    store_cli.add_parser(subparsers)
    worker_cli.add_parser(subparsers)
    conductor_cli.add_parser(subparsers)
    bench_cli.add_parser(subparsers)
    roofline_cli.add_parser(subparsers)
    sim_cli.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvpool.common import auth

    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        auth.export_cli_tokens(args)
    except ValueError as exc:
        print(f"kvpool {args.command}: {exc}", file=sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

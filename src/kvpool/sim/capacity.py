"""Effective request capacity against the TBT threshold (the paper's capacity figure).

The trace is replayed at several multiples of its request rate; at each TBT threshold a
system's effective capacity is the highest rate at which at least ``quantile`` (90 %) of all
requests, rejected ones included, got their first token within the TTFT SLO and kept their TBT
(mean of the longest 10 % of gaps) within the threshold: the highest swept rate that does,
linearly interpolated towards the next rate, where the share falls below ``quantile``.
"""

from __future__ import annotations

from dataclasses import replace

from kvpool.bench.metrics import meets
from kvpool.bench.report import PLOT_THRESHOLDS
from kvpool.bench.trace import ScaleConfig, TraceRequest
from kvpool.sim.run import simulate
from kvpool.sim.systems import SimConfig, SystemSpec
from kvpool.sim.workload import scale_requests, workload_facts


def scaled_at(trace: list[TraceRequest], cfg: ScaleConfig, factor: float):
    """The workload at ``factor`` times its request rate."""
    if factor <= 0:
        raise ValueError("rate factors must be > 0")
    if cfg.rate is not None:
        return scale_requests(trace, replace(cfg, rate=cfg.rate * factor))
    return scale_requests(trace, replace(cfg, time_scale=cfg.time_scale / factor))


def capacity_sweep(systems: list[SystemSpec], cfg: SimConfig, trace: list[TraceRequest],
                   scale_cfg: ScaleConfig, factors: list[float], quantile: float = 0.9,
                   thresholds: tuple[float, ...] = PLOT_THRESHOLDS,
                   progress: bool = False) -> dict:  # fmt: skip
    """Per system: each rate's share of requests meeting the SLOs at each TBT threshold, and
    the effective capacity (requests/s) at each threshold."""
    if not 0 < quantile <= 1:
        raise ValueError("quantile must be in (0, 1]")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(systems) * len(factors), desc="capacity sweep", unit="run")
    points: dict[str, list[dict]] = {s.name: [] for s in systems}
    try:
        for factor in sorted(factors):
            reqs = scaled_at(trace, scale_cfg, factor)
            rate = workload_facts(reqs, cfg.block_tokens).get("rate_per_s") or 0.0
            for system in systems:
                res = simulate(system, cfg, reqs)  # a named policy is made anew per run
                n = max(1, len(res.records))
                share = {f"{th:g}": sum(meets(r, cfg.slo_ttft, th) for r in res.records) / n
                         for th in thresholds}  # fmt: skip
                points[system.name].append({"factor": factor, "rate_per_s": rate,
                                            "share": share,
                                            "mean_ttft_s": res.summary["mean_ttft_s"],
                                            "rejected": res.summary["rejected"]})  # fmt: skip
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    capacity = {name: {f"{th:g}": crossing(pts, f"{th:g}", quantile) for th in thresholds}
                for name, pts in points.items()}  # fmt: skip
    return {"quantile": quantile, "slo_ttft_s": cfg.slo_ttft, "factors": sorted(factors),
            "thresholds": list(thresholds), "points": points, "capacity": capacity}  # fmt: skip


def crossing(points: list[dict], threshold: str, quantile: float) -> float:
    """The rate where the share meeting the SLOs at ``threshold`` falls to ``quantile``: the
    highest passing rate, interpolated towards the next (failing) one; 0 if none passes."""
    pts = sorted(points, key=lambda p: p["rate_per_s"])
    passing = [i for i, p in enumerate(pts) if p["share"][threshold] >= quantile]
    if not passing:
        return 0.0
    i = passing[-1]
    lo = pts[i]
    if i + 1 == len(pts):
        return lo["rate_per_s"]
    hi = pts[i + 1]
    a, b = lo["share"][threshold], hi["share"][threshold]
    return lo["rate_per_s"] + (a - quantile) / (a - b) * (hi["rate_per_s"] - lo["rate_per_s"])

"""Running systems over a workload: one simulation each, with a progress bar."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvpool.sim.cluster import SimCluster
from kvpool.sim.results import SimRecord, records, summary_of
from kvpool.sim.systems import SimConfig, SystemSpec
from kvpool.sim.workload import SimRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SystemResult:
    name: str
    records: list[SimRecord]
    summary: dict
    details: dict = field(default_factory=dict)
    wall_s: float = 0.0


def simulate(system: SystemSpec, cfg: SimConfig, requests: list[SimRequest],
             progress: bool = False) -> SystemResult:  # fmt: skip
    """Simulate ``requests`` on ``system`` to the end of the last one."""
    t0 = time.perf_counter()
    cluster = SimCluster(system, cfg, requests)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=f"sim {system.name}", unit="req", mininterval=1.0)
        cluster.on_done = lambda: bar.update(1)
    try:
        cluster.run()
    finally:
        if bar is not None:
            bar.close()
    recs = records(cluster)
    summary, details = summary_of(cluster, recs)
    wall = time.perf_counter() - t0
    summary["sim_wall_s"] = wall
    logger.info("simulated %s: %d requests, %d events in %.1fs", system.name, len(requests),
                cluster.loop.events, wall)  # fmt: skip
    return SystemResult(system.name, recs, summary, details, wall)


def simulate_all(systems: list[SystemSpec], cfg: SimConfig, requests: list[SimRequest],
                 progress: bool = False) -> dict[str, SystemResult]:  # fmt: skip
    out: dict[str, SystemResult] = {}
    for s in systems:
        if s.name in out:
            raise ValueError(f"two systems named {s.name!r}")
        out[s.name] = simulate(s, cfg, requests, progress)
    return out

"""What this machine moves and computes: read and copy bandwidth (from memory, and over working
sets that may fit in its caches), the float32 GEMM rate and the block kernel's rate, measured
once and cached per CPU and thread count (the ceilings of the roofline: ``bench/roofline.py``,
``kvpool roofline``, the engine's decode figures)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import asdict, dataclass, field

import torch

from kvpool.model.autotune import ROWS, best_time, cached, cpu_id, cpu_name

logger = logging.getLogger(__name__)

BANDWIDTH_BYTES = 512 << 20  # what the bandwidth probe streams (beyond the caches of most CPUs)
# Smaller working sets read again and again (a decode step reads the same weights every step):
# where they fit in the last-level cache, the machine reads them faster than from memory. Some
# server CPUs have hundreds of MB of it (an Intel Xeon of 2026-12-07: 480 MB of L3, its 2 vCPUs
# reading 51 GB/s at 64 MB, 39 at 120 MB, 23 from 240 MB on), so a step's ceiling is the
# bandwidth at its own bytes, never below the far probe's.
CURVE_BYTES = (16 << 20, 64 << 20, 128 << 20, 256 << 20)


@dataclass(slots=True)
class MachineLimits:
    """What this machine moves and computes, measured with ``threads`` threads."""

    cpu: str
    threads: int
    read_gbps: float  # streaming a buffer once (what a decode step does with its weights)
    copy_gbps: float  # read + write of a copy
    gemm_gflops: float  # float32 GEMM, large square matrices
    # the block kernel's multiply-adds x 2 per second by batch rows (kernels/qgemm.cpp, a
    # 3072 x 1024 q4 matrix): its rate grows with the rows that share each weight block
    block_gops: dict[int, float] = field(default_factory=dict)
    # the read bandwidth over working sets of CURVE_BYTES, each read again and again (GB/s)
    read_curve: dict[int, float] = field(default_factory=dict)

    def read_ceiling(self, nbytes: float) -> float:
        """GB/s this machine reads a working set of ``nbytes`` at, read again and again: the
        curve interpolated linearly in size, the far probe (``read_gbps``) beyond its end and
        wherever the curve is lower."""
        curve = sorted(self.read_curve.items())
        if not curve or nbytes > curve[-1][0]:
            return self.read_gbps
        if nbytes <= curve[0][0]:
            return max(self.read_gbps, curve[0][1])
        for (s0, g0), (s1, g1) in itertools.pairwise(curve):
            if s0 <= nbytes <= s1:
                return max(self.read_gbps, g0 + (g1 - g0) * (nbytes - s0) / (s1 - s0))
        return self.read_gbps

    def block_rate(self, rows: int) -> float:
        """GOP/s of the block kernel at ``rows`` (the nearest measured batch below)."""
        known = sorted(self.block_gops)
        if not known:
            return 0.0
        below = [r for r in known if r <= rows] or known[:1]
        return self.block_gops[below[-1]]

    @classmethod
    def from_json(cls, d: dict) -> MachineLimits:
        d = dict(d)
        d["block_gops"] = {int(k): float(v) for k, v in d["block_gops"].items()}
        d["read_curve"] = {int(k): float(v) for k, v in d["read_curve"].items()}
        return cls(**d)


def read_gbps(nbytes: int = BANDWIDTH_BYTES) -> float:
    """The read bandwidth now (GB/s): the best of five passes summing a buffer of ``nbytes``
    after one untimed pass. Of BANDWIDTH_BYTES, what memory gives; smaller, what the caches
    give a working set that size read again and again (``kvpool roofline`` measures both beside
    each round of decode steps)."""
    src = torch.ones(max(1, int(nbytes) // 4))
    return src.numel() * 4 / best_time(lambda: src.sum(), reps=5) / 1e9


def measure_machine(kernels=None) -> MachineLimits:
    """Read and copy bandwidth, float32 GEMM rate, the block kernel's rate and the read
    bandwidth over smaller working sets, measured now."""
    n = BANDWIDTH_BYTES // 4
    src, dst = torch.ones(n), torch.empty(n)
    read = read_gbps()
    copy = best_time(lambda: dst.copy_(src), reps=5)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    gemm = best_time(lambda: torch.mm(a, b))
    block: dict[int, float] = {}
    if kernels is not None:
        from kvpool.model.linear import packed_or_none
        from kvpool.model.quant import quantize

        w = quantize(torch.randn(3072, 1024) * 0.02, "q4")  # 1.9 MB: cache-resident
        pk = packed_or_none(kernels, w)  # what decode runs up to GEMV_ROWS rows
        for rows in ROWS:
            x = torch.randn(rows, 1024)
            t = best_time(lambda x=x: kernels.qlinear(x, w.qs, w.d, w.m, packed=pk))
            block[rows] = 2 * rows * 3072 * 1024 / t / 1e9
    curve = {n: read_gbps(n) for n in CURVE_BYTES}
    return MachineLimits(cpu_name(), torch.get_num_threads(), read,
                         2 * BANDWIDTH_BYTES / copy / 1e9, 2 * 1024**3 / gemm / 1e9, block,
                         curve)  # fmt: skip


def _valid(d: object) -> bool:
    try:
        MachineLimits.from_json(d)  # type: ignore[arg-type]
        return True
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def machine_limits(kernels=None, fresh: bool = False) -> MachineLimits:
    """``measure_machine``, cached per CPU and thread count (``fresh``: measure again)."""
    key = f"{cpu_id()}|t{torch.get_num_threads()}|{'k' if kernels else '-'}"
    d = cached("machine", key, lambda: asdict(measure_machine(kernels)), _valid, fresh)
    return MachineLimits.from_json(d)


def known_limits() -> MachineLimits | None:
    """The limits measured before on this machine with either kernel setting, or None (a
    server reports them if ``kvpool roofline`` measured them; it never measures itself)."""
    import json

    from kvpool.model.cache import cache_root

    try:
        known = json.loads((cache_root() / "autotune" / "machine.json").read_text())
    except (OSError, ValueError):
        return None
    prefix = f"{cpu_id()}|t{torch.get_num_threads()}|"
    for mark in ("k", "-"):
        if _valid(known.get(prefix + mark)):
            return MachineLimits.from_json(known[prefix + mark])
    return None

"""Choices measured on this CPU, once, then cached: which weight format ``auto`` means, and up
to how many rows a batch runs the block kernel rather than BLAS.

Machines differ (AVX-512 Xeons run float32 BLAS far faster than an AVX2-only EPYC does), so
nothing here is a constant: a few timed calls on matrices of the model's own shapes decide, and
the result is kept in ``<cache>/autotune/`` keyed by the CPU, torch, the thread count and the
shapes (``KVPOOL_SMALL_ROWS`` overrides the measured limit).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

from kvpool.model.cache import cache_root
from kvpool.model.quant import quantize

logger = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes tried, in order
_ENV = "KVPOOL_SMALL_ROWS"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(kind: str, k: int, n: int) -> str:
    return f"{cpu_name()}|torch-{torch.__version__}|t{torch.get_num_threads()}|{kind}|{k}x{n}"


def best_time(fn, reps: int = 3) -> float:
    """The fastest of ``reps`` timed calls of ``fn``, after one untimed (warm-up)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_small_rows(kernels: ModuleType, kind: str, k: int, n: int) -> int:
    """The largest batch in ``ROWS`` up to which the block kernel is faster than BLAS for a
    ``[n, k]`` matrix of ``kind`` blocks (0 if it never is)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    bw, w_t = quantize(w, kind), w.t().contiguous()
    limit = 0
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        blocks = best_time(lambda x=x: kernels.qlinear(x, bw.qs, bw.d, bw.m))
        dense = best_time(lambda x=x: torch.mm(x, w_t))
        if blocks >= dense:
            break
        limit = rows
    return limit


def cached(name: str, key: str, measure, valid, fresh: bool = False):
    """``measure()``, kept under ``key`` in ``<cache>/autotune/<name>.json`` and read back from
    there by later calls (unless ``fresh``) when ``valid(value)`` holds."""
    path = cache_root() / "autotune" / f"{name}.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not fresh and key in known and valid(known[key]):
        return known[key]
    value = known[key] = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache only costs a measurement per start
        logger.info("could not cache the measurement (%s)", exc)
    return value


def small_rows(kernels: ModuleType, kind: str, k: int, n: int) -> int:
    """``measure_small_rows``, from the cache when this machine measured it before."""
    if os.environ.get(_ENV):
        return int(os.environ[_ENV])

    def measure() -> int:
        t0 = time.perf_counter()
        limit = measure_small_rows(kernels, kind, k, n)
        logger.info("block kernel (%s, %dx%d) beats BLAS up to %d rows here (measured in "
                    "%.1f s)", kind, n, k, limit, time.perf_counter() - t0)  # fmt: skip
        return limit

    return cached("small_rows", _key(kind, k, n), measure, lambda v: isinstance(v, int))

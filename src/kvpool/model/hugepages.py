"""Weights and KV cache on transparent huge pages.

A decode step streams every weight once, ~120 small tensors a step (four linear layers per
layer, each a few hundred KB, then the 30 MB output head), and its KV in 12 KB pieces. On 4 KB
pages each of those streams misses the TLB every 4 KB and starts cold; torch allocates below
2 MB without huge pages whatever the system allows. So the model's block weights are copied
once, at load, into one arena in the order a step reads them, 2 MB-aligned and advised
``MADV_HUGEPAGE`` before anything touches it; the dense fallbacks and the KV cache get the
advice as well. Measured on an AMX Xeon (512 tokens of context, two engines in one process
alternating: ``benchmarks/bench_hugepages.py``): decode steps 1.16x faster at batch 1, 1.15x at
8, 1.08x at 32; the 30 MB output head alone ~1.6x (docs/benchmarks.md).

Only advice: where the kernel has no transparent huge pages (``enabled`` is ``never``, or not
built in) nothing is copied and the memory is torch's. ``KVPOOL_HUGEPAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import sys

import torch

logger = logging.getLogger(__name__)

HUGE = 2 << 20  # the x86-64 / arm64 (4 KB granule) transparent huge page
_MADV_HUGEPAGE = 14
_ALIGN = 64  # each tensor of an arena starts on a cache line


_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def enabled() -> bool:
    """Whether the arenas and the advice are used: Linux with transparent huge pages in
    ``always`` or ``madvise`` mode, and not ``KVPOOL_HUGEPAGES=0`` (else the weights stay where
    torch put them: a copy would gain nothing)."""
    if os.environ.get("KVPOOL_HUGEPAGES", "1") in ("0", "false", "no", ""):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(_THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


_libc = None


def _madvise(addr: int, length: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    rc = _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    if rc != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return rc == 0


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``nbytes`` starting on a 2 MB boundary, advised
    ``MADV_HUGEPAGE`` before its first touch (the backing allocation is kept alive by the view).
    Without huge pages (or disabled) a plain ``torch.empty``."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    if not enabled() or nbytes < HUGE // 2:
        return torch.empty(nbytes, dtype=torch.uint8)
    span = (nbytes + HUGE - 1) // HUGE * HUGE  # whole huge pages, all inside the allocation
    raw = torch.empty(span + HUGE, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE
    _madvise(raw.data_ptr() + off, span)
    return raw[off : off + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on huge pages (the KV cache)."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if size == 0 or not enabled():
        return torch.zeros(shape, dtype=dtype)
    return empty(size).view(dtype).view(shape).zero_()


class Arena:
    """Room for tensors of known sizes, one after another (each on a cache line) in one
    huge-page buffer: ``place`` copies a tensor in and gives the copy. Callers place and drop
    their originals one at a time, so a model's weights are never all held twice."""

    def __init__(self, sizes: list[int]) -> None:
        total = sum(_lined(n) for n in sizes)
        self._buf = empty(max(total, 1))
        self._at = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        n = nbytes(t)
        if self._at + n > self._buf.numel():
            raise ValueError("the arena is full: a tensor larger than its share was placed")
        view = self._buf[self._at : self._at + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        self._at += _lined(n)
        return view


def _lined(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

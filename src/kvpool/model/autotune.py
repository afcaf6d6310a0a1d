"""Choices measured on this CPU, once, then cached: which weight format ``auto`` means, up to
how many rows a decode batch runs the block kernel rather than BLAS, and which of the two runs
steps with prompt tokens, or whether AMX tiles run them faster than either (where the CPU has
them: ``kernels/amx.cpp``).

Machines differ (AVX-512 Xeons run float32 BLAS far faster than an AVX2-only EPYC does), so
nothing here is a constant: a few timed calls on matrices of the model's own shapes decide, and
the result is kept in ``<cache>/autotune/`` keyed by the CPU, torch, the kernels' build (a
digest of their sources), the thread count and the shapes (``KVPOOL_SMALL_ROWS``,
``KVPOOL_PROMPT_BLOCKS`` and ``KVPOOL_PROMPT_AMX`` override the measurements).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

from kvpool.model.cache import cache_root
from kvpool.model.linear import packed_or_none, prompt_args
from kvpool.model.quant import quantize

logger = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes tried, in order
PROMPT_ROWS = 512  # a prompt step's rows, as measured for ``prompt_blocks``
_ENV = "KVPOOL_SMALL_ROWS"
_PROMPT_ENV = "KVPOOL_PROMPT_BLOCKS"
_AMX_ENV = "KVPOOL_PROMPT_AMX"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_id(cpuinfo: str | None = None) -> str:
    """The CPU as cache keys name it (from ``/proc/cpuinfo``, or the text given): its model
    name is not enough (the same "AMD EPYC" is a Zen 1 with AVX2 on one machine and a Zen 4
    with AVX-512 on the next), so family, model, stepping and a digest of the feature flags
    go with it."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:8]
    return (f"{name}|f{fields.get('cpu family', '?')}-m{fields.get('model', '?')}"
            f"-s{fields.get('stepping', '?')}|{flags}")  # fmt: skip


def _key(kernels: ModuleType, kind: str, k: int, n: int) -> str:
    # the build directory's name holds torch's version and a digest of the kernels' sources
    build = Path(getattr(kernels, "__file__", "") or "unknown").parent.name
    return f"{cpu_id()}|{build}|t{torch.get_num_threads()}|{kind}|{k}x{n}"


def best_time(fn, reps: int = 3) -> float:
    """The fastest of ``reps`` timed calls of ``fn``, after one untimed (warm-up)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


STREAM_BYTES = 64 * 2**20  # more than a server CPU's last-level cache slice holds


def measure_small_rows(kernels: ModuleType, kind: str, k: int, n: int) -> int:
    """The largest batch in ``ROWS`` up to which the block kernel is faster than BLAS for a
    ``[n, k]`` matrix of ``kind`` blocks (0 if it never is).

    A decode step reads every layer's weights once, from memory (a model's weights do not
    stay in cache between steps), so both sides are timed the same way: each call takes the
    next of enough copies of the matrix that the one it reads was evicted since its last use."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    copies = max(1, min(16, -(-STREAM_BYTES // (4 * n * k))))
    dense_copies = [w.t().contiguous() for _ in range(copies)]
    block_copies = [quantize(w, kind) for _ in range(copies)]
    # decode runs up to GEMV_ROWS rows over a repacked copy (kernels/gemv.cpp): time that
    packed = [packed_or_none(kernels, bw) for bw in block_copies]
    turn = [0]

    def next_copy(pool: list):
        turn[0] += 1
        return pool[turn[0] % len(pool)]

    limit = 0
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)

        def blocks_call(x=x):
            turn[0] += 1
            i = turn[0] % copies
            bw = block_copies[i]
            kernels.qlinear(x, bw.qs, bw.d, bw.m, packed=packed[i])

        blocks = best_time(blocks_call)
        dense = best_time(lambda x=x: torch.mm(x, next_copy(dense_copies)))
        if blocks >= dense:
            break
        limit = rows
    return limit


def measure_prompt_blocks(kernels: ModuleType, kind: str, k: int, n: int) -> bool:
    """Whether the block kernel is faster than BLAS for ``PROMPT_ROWS`` rows of a ``[n, k]``
    matrix of ``kind`` blocks. A prompt step reuses each weight for many rows, so the matrix is
    read from cache here, on both sides."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    dense, bw = w.t().contiguous(), quantize(w, kind)
    x = torch.randn(PROMPT_ROWS, k, generator=g)
    blocks = best_time(lambda: kernels.qlinear(x, bw.qs, bw.d, bw.m, **prompt_args()))
    return blocks < best_time(lambda: torch.mm(x, dense))


def measure_prompt_amx(kernels: ModuleType, kind: str | None, k: int, n: int) -> bool:
    """Whether AMX tiles run ``PROMPT_ROWS`` rows of a ``[n, k]`` matrix faster than BLAS and
    (for ``kind`` blocks, None for float32 weights) the block kernel: from cache, as
    ``measure_prompt_blocks`` times them."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    dense, tiles = w.t().contiguous(), kernels.amx_pack(w)
    x = torch.randn(PROMPT_ROWS, k, generator=g)
    others = [best_time(lambda: torch.mm(x, dense))]
    if kind is not None:
        bw = quantize(w, kind)
        others.append(best_time(lambda: kernels.qlinear(x, bw.qs, bw.d, bw.m, **prompt_args())))
    return best_time(lambda: kernels.amx_linear(x, tiles)) < min(others)


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

    return cached("small_rows", _key(kernels, kind, k, n), measure,
                  lambda v: isinstance(v, int))  # fmt: skip


def prompt_blocks(kernels: ModuleType, kind: str, k: int, n: int) -> bool:
    """``measure_prompt_blocks``, from the cache when this machine measured it before."""
    if os.environ.get(_PROMPT_ENV):
        return os.environ[_PROMPT_ENV] not in ("0", "false", "no")

    def measure() -> bool:
        t0 = time.perf_counter()
        faster = measure_prompt_blocks(kernels, kind, k, n)
        logger.info("prompt steps (%s, %dx%d) run %s here (measured in %.1f s)", kind, n, k,
                    "the block kernel" if faster else "BLAS", time.perf_counter() - t0)  # fmt: skip
        return faster

    return cached("prompt_blocks", _key(kernels, kind, k, n), measure,
                  lambda v: isinstance(v, bool))  # fmt: skip


def prompt_amx(kernels: ModuleType | None, kind: str | None, k: int, n: int) -> bool:
    """Whether prompt steps of a ``[n, k]`` layer run on AMX tiles here: never where the build
    or the CPU has none; as ``KVPOOL_PROMPT_AMX`` says where set; else never for float32
    weights (``kind`` None: the format asked for float32 arithmetic, which the tiles' ~16 bits
    an operand are not) nor where ``KVPOOL_PROMPT_BLOCKS`` chose between the block kernel and
    BLAS; else ``measure_prompt_amx``, from the cache when measured before."""
    if kernels is None or not kernels.has_amx() or n % 16 or k % 32:
        return False
    if os.environ.get(_AMX_ENV):
        return os.environ[_AMX_ENV] not in ("0", "false", "no")
    if kind is None or os.environ.get(_PROMPT_ENV):
        return False

    def measure() -> bool:
        t0 = time.perf_counter()
        faster = measure_prompt_amx(kernels, kind, k, n)
        logger.info("prompt steps (%s, %dx%d) %s on AMX tiles here (measured in %.1f s)",
                    kind or "float32", n, k, "run" if faster else "do not run",
                    time.perf_counter() - t0)  # fmt: skip
        return faster

    return cached("prompt_amx", _key(kernels, kind or "float32", k, n), measure,
                  lambda v: isinstance(v, bool))  # fmt: skip

"""Optional C++ kernels, compiled on first use with the machine's C++ compiler.

``paged_decode_attention`` reads keys and values where they lie in the block-major cache
instead of gathering copies, which matters at long contexts and with shared prefixes. If the
compiler (or ninja) is missing, or ``KVPOOL_NO_KERNELS=1`` is set, :func:`paged_kernels`
returns None and attention falls back to gather + SDPA (same results, slower).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def _build_dir() -> Path:
    import torch

    root = Path(os.environ.get("KVPOOL_CACHE_DIR", Path.home() / ".cache" / "kvpool"))
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    return root / "kernels" / f"torch-{torch.__version__}-{digest}"


def paged_kernels() -> ModuleType | None:
    """The compiled kernel module, or None when kernels are disabled or cannot be built."""
    with _lock:
        if "mod" not in _state:
            _state["mod"] = _load()
        return _state["mod"]


def _load() -> ModuleType | None:
    if os.environ.get("KVPOOL_NO_KERNELS", "") not in ("", "0"):
        logger.info("C++ kernels disabled by KVPOOL_NO_KERNELS")
        return None
    try:
        from torch.utils import cpp_extension

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        fresh = not any(build.glob("*.so"))
        if fresh:
            logger.info("compiling the paged-attention kernel into %s (first use, ~1 min)", build)
        start = time.perf_counter()
        mod = cpp_extension.load(
            name="kvpool_paged_attention",
            sources=[str(_SOURCE)],
            # -fopenmp: at::parallel_for is header code, serial unless built with OpenMP
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
        if fresh:
            logger.info("kernel built in %.1f s", time.perf_counter() - start)
        return mod
    except Exception as e:  # no compiler, no ninja, ...: the gather path still works
        logger.warning("C++ kernels unavailable (%s); using gather + SDPA attention", e)
        return None

"""Optional C++ kernels, compiled on first use with the machine's C++ compiler.

``paged_kernels()``: ``paged_decode_attention`` reads keys and values where they lie in the
block-major cache instead of gathering copies, which matters at long contexts and with shared
prefixes. ``quant_kernels()``: ``qlinear``, linear layers over 32-block quantized weights
(``model/quant.py``). If the compiler (or ninja) is missing, or ``KVPOOL_NO_KERNELS=1`` is set,
they return None: attention falls back to gather + SDPA (same results, slower), and quantized
weight formats are refused with a clear error. Where a compiler exists, a failed build is a
bug: ``tests/model/test_kernel_build.py`` fails on it.
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

_DIR = Path(__file__).parent
_KERNELS = (
    "paged_attention",
    "qgemm",
    "lanes",
    "gemv",
    "decode",
    "amx",
    "amx_attention",
    "bindings",
)
_SOURCES = [_DIR / f"{n}.cpp" for n in _KERNELS]
_HEADERS = [_DIR / "kernels.h", _DIR / "qblocks.h", _DIR / "amx.h"]
_NAME = "kvpool_kernels"
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}
last_error: dict[str, str] = {}  # module name -> why it did not build


def _build_dir() -> Path:
    import torch

    root = Path(os.environ.get("KVPOOL_CACHE_DIR", Path.home() / ".cache" / "kvpool"))
    digest = hashlib.sha256()
    for f in _SOURCES + _HEADERS:
        digest.update(f.read_bytes())
    return root / "kernels" / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"


def kernels() -> ModuleType | None:
    """The compiled kernel module (attention, quantized linear layers, the fused decode step),
    or None when kernels are disabled or cannot be built (``last_error`` says why)."""
    with _lock:
        if _NAME not in _state:
            _state[_NAME] = _load()
        return _state[_NAME]


# the parts' names, for their callers
paged_kernels = quant_kernels = kernels


def disabled() -> bool:
    return os.environ.get("KVPOOL_NO_KERNELS", "") not in ("", "0")


def _load() -> ModuleType | None:
    if disabled():
        logger.info("C++ kernels disabled by KVPOOL_NO_KERNELS")
        last_error[_NAME] = "disabled by KVPOOL_NO_KERNELS"
        return None
    try:
        from torch.utils import cpp_extension

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        fresh = not any(build.glob("*.so"))
        if fresh:
            logger.info("compiling kvpool's C++ kernels into %s (first use, ~2 min)", build)
        start = time.perf_counter()
        mod = cpp_extension.load(
            name=_NAME,
            sources=[str(f) for f in _SOURCES],
            # -fopenmp: at::parallel_for is header code, serial unless built with OpenMP
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
        if fresh:
            logger.info("kernel built in %.1f s", time.perf_counter() - start)
        return mod
    except Exception as e:  # no compiler, no ninja, ...: the fallbacks still work
        logger.warning("C++ kernels unavailable (%s)", e)
        last_error[_NAME] = f"{type(e).__name__}: {e}"
        return None

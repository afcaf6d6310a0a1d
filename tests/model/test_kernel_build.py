"""Where a C++ compiler exists, the kernels must build: a failed build is a bug, not a skip.

kvpool falls back to gather + SDPA attention and float32 weights without them, so a broken
build would otherwise only show as a slower engine (and the kernel tests skipping).
"""

import importlib.util
import os
import shutil

import pytest

from kvpool.model import kernels as kmod


def test_kernels_build_where_a_compiler_exists():
    if os.environ.get("KVPOOL_NO_KERNELS", "") not in ("", "0"):
        pytest.skip("KVPOOL_NO_KERNELS is set: kernels are disabled on purpose")
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None or importlib.util.find_spec("ninja") is None:
        pytest.skip(f"no C++ compiler ({compiler}) or no ninja: the fallbacks are expected")
    mod = kmod.kernels()
    assert mod is not None, f"the kernels did not build: {kmod.last_error}"
    for name in ("paged_decode_attention", "qlinear", "DecodeModel"):
        assert hasattr(mod, name)


def test_disabled_kernels_say_why(monkeypatch):
    monkeypatch.setenv("KVPOOL_NO_KERNELS", "1")
    monkeypatch.setattr(kmod, "last_error", {})
    assert kmod._load() is None
    assert "KVPOOL_NO_KERNELS" in kmod.last_error["kvpool_kernels"]

"""The C++ kernels run without the GIL unless told to hold it (kernels/bindings.cpp): released,
a worker's other Python threads (background KV loads and saves, RPC servers) keep running while
a step computes; held, they wait for the call to return (what the engine asks for steps with
no load in flight)."""

import subprocess
import sys
import threading
import time

import pytest
import torch

from kvpool.model.kernels import kernels
from kvpool.model.quant import quantize

kern = kernels()
pytestmark = pytest.mark.skipif(kern is None, reason="no C++ compiler for the kernels")


def ticker_gaps(release: bool) -> tuple[float, float]:
    """The longest pause of a pure-Python thread while kernels compute, and one call's time."""
    bw = quantize(torch.randn(1024, 1024) * 0.05, "q4")
    x = torch.randn(64, 1024)
    stamps: list[float] = []
    stop = threading.Event()

    def tick() -> None:  # pure Python: runs only while it holds the GIL
        while not stop.is_set():
            stamps.append(time.perf_counter())

    before, released = torch.get_num_threads(), kern.release_gil()
    torch.set_num_threads(1)  # a core left for the ticking thread
    kern.set_release_gil(release)
    ticker = threading.Thread(target=tick, daemon=True)
    try:
        ticker.start()
        while not stamps:
            time.sleep(0.001)
        calls = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.2 or calls < 2:  # scalar path: tens of ms a call
            kern.qlinear(x, bw.qs, bw.d, bw.m, portable=True)
            calls += 1
        t1 = time.perf_counter()
    finally:
        stop.set()
        ticker.join()
        torch.set_num_threads(before)
        kern.set_release_gil(released)
    inside = [t for t in stamps if t0 <= t <= t1]
    gaps = [b - a for a, b in zip([t0, *inside], [*inside, t1], strict=True)]
    return max(gaps), (t1 - t0) / calls


def test_other_threads_run_while_a_kernel_computes():
    gap, call_s = ticker_gaps(release=True)
    assert gap < 0.5 * call_s, (gap, call_s)  # holding the GIL, it would stop for whole calls


def test_a_fresh_process_releases_the_gil():
    out = subprocess.run([sys.executable, "-c", "from kvpool.model.kernels import kernels; "
                          "print(kernels().release_gil())"], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_told_to_hold_the_gil_a_kernel_keeps_other_threads_waiting():
    gap, call_s = ticker_gaps(release=False)
    assert gap > 0.8 * call_s, (gap, call_s)

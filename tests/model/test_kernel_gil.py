"""The C++ kernels run without the GIL: a worker's other Python threads (background KV loads
and saves, RPC servers) keep running while a step computes (kernels/bindings.cpp)."""

import threading
import time

import pytest
import torch

from kvpool.model.kernels import kernels
from kvpool.model.quant import quantize

kern = kernels()
pytestmark = pytest.mark.skipif(kern is None, reason="no C++ compiler for the kernels")


def test_other_threads_run_while_a_kernel_computes():
    bw = quantize(torch.randn(1024, 1024) * 0.05, "q4")
    x = torch.randn(64, 1024)
    stamps: list[float] = []
    stop = threading.Event()

    def tick() -> None:  # pure Python: runs only while it holds the GIL
        while not stop.is_set():
            stamps.append(time.perf_counter())

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a core left for the ticking thread
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
    inside = [t for t in stamps if t0 <= t <= t1]
    call_s = (t1 - t0) / calls
    gaps = [b - a for a, b in zip([t0, *inside], [*inside, t1], strict=True)]
    # holding the GIL, the ticker would stop for whole calls
    assert max(gaps) < 0.5 * call_s, (max(gaps), call_s, calls)

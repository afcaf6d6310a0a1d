"""How the engine's steps run while KV loads are in flight (the load thread's share of the CPU).

Two switches, both set before each step from whether any load is in flight:

- the kernels let go of the GIL only then, for the load thread to run during the step;
  otherwise the process's other threads would take a core from the step's OpenMP team
  mid-step (``kernels/bindings.cpp``);
- the step runs on one thread fewer (never fewer than one), and goes back once none is. The
  load thread (and the transfer's) then has a core of its own instead of taking one from the
  step's team mid-step, whose barriers all wait for the descheduled thread: on an AMX Xeon
  under Linux 6.18, where the load thread's lower priority did not keep it off the step's
  cores, ``bench_overlap.py``'s streams had a TBT p99 of 134 ms during loads against 34 ms this
  way, loads took 51 ms against 36, and the loaded requests' first token came at 217 ms
  against 149 (docs/benchmarks.md). Where a worker shares the host's cores, its ledger
  (``engine/core_share.py``) sets each step's threads and is told how many to leave instead.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch


class LoadsInFlight:
    def __init__(self, kernels: ModuleType | None) -> None:
        self.kernels = kernels
        # the core ledger's ``leave`` where the worker shares the host's cores (set by the
        # async engine); else torch's threads are narrowed here, remembering the count
        self.reserve_threads: Callable[[int], None] | None = None
        self._threads_before: int | None = None

    def before_step(self, loading: bool) -> None:
        if self.kernels is not None:
            self.kernels.set_release_gil(loading)
        self.leave_core(loading)

    def leave_core(self, loading: bool) -> None:
        """One thread fewer while ``loading``; as before once not."""
        if self.reserve_threads is not None:
            self.reserve_threads(1 if loading else 0)
        elif loading and self._threads_before is None:
            threads = torch.get_num_threads()
            if threads > 1:
                self._threads_before = threads
                torch.set_num_threads(threads - 1)
        elif not loading and self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

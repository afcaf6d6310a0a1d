"""The discrete-event loop: a heap of timed callbacks.

Events at the same time run in priority order (lower first), then in the order they were
scheduled, so a run is deterministic. Priorities used by the simulator: work that finishes
(step ends, transfers) before the conductor's poll, the poll before new arrivals, arrivals
before the timeline's samples.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

FINISH, POLL, ARRIVAL, SAMPLE = 0, 1, 2, 3


class EventLoop:
    __slots__ = ("_heap", "_seq", "events", "now")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Callable, tuple]] = []
        self._seq = 0
        self.now = 0.0
        self.events = 0  # events run so far

    def at(self, t: float, fn: Callable, *args, prio: int = FINISH) -> None:
        """Run ``fn(*args)`` at time ``t`` (never before now)."""
        if t < self.now:
            raise ValueError(f"cannot schedule an event in the past ({t} < {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (t, prio, self._seq, fn, args))

    def after(self, dt: float, fn: Callable, *args, prio: int = FINISH) -> None:
        self.at(self.now + dt, fn, *args, prio=prio)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float = math.inf) -> float:
        """Run events up to time ``until`` (inclusive); the time of the last one run."""
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)
        return self.now

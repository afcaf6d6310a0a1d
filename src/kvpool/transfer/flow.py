"""Flow control of the transfer engine: the in-flight bound per peer and request deadlines."""

from __future__ import annotations

import heapq
import threading
import time

from kvpool.common.errors import BackpressureError
from kvpool.transfer.request import PendingOp


class Inflight:
    """Bytes in flight to one peer, bounded (a single oversized batch may pass when idle)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waiters = 0
        self._cond = threading.Condition(threading.Lock())

    def acquire(self, n: int, block: bool, timeout: float, peer: str) -> None:
        with self._cond:
            ok = self.used == 0 or self.used + n <= self.limit
            if not ok and block:
                self.waiters += 1
                try:
                    ok = self._cond.wait_for(
                        lambda: self.used == 0 or self.used + n <= self.limit, timeout
                    )
                finally:
                    self.waiters -= 1
            if not ok:
                raise BackpressureError(
                    f"{self.used} bytes already in flight to {peer} (limit {self.limit}); "
                    f"{n} more would exceed it"
                )
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            if self.waiters:
                self._cond.notify_all()


class Reaper:
    """Cancels requests that pass their deadline (one thread per engine)."""

    def __init__(self, on_deadline) -> None:
        # The heap holds (deadline, key) only; ops live in `_live` until they finish, so a
        # finished op is freed at once (no long-lived garbage for the cyclic GC to walk).
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, PendingOp] = {}
        self._cond = threading.Condition(threading.Lock())
        self._seq = 0
        self._closed = False
        self._on_deadline = on_deadline
        self._thread = threading.Thread(
            target=self._run, name="kvpool-transfer-reaper", daemon=True
        )
        self._thread.start()

    def add(self, ops: list[PendingOp]) -> None:
        with self._cond:
            earliest = self._heap[0][0] if self._heap else float("inf")
            for op in ops:
                self._seq += 1
                op.reaper_key = self._seq
                self._live[self._seq] = op
                heapq.heappush(self._heap, (op.deadline, self._seq))
            if len(self._heap) > 4 * len(self._live) + 1024:  # drop stale keys (amortized)
                self._heap = [e for e in self._heap if e[1] in self._live]
                heapq.heapify(self._heap)
            if self._heap and self._heap[0][0] < earliest:  # wake it only to sleep less
                self._cond.notify()

    def discard(self, ops: list[PendingOp]) -> None:
        """Forget finished ops (their heap keys go stale)."""
        keys = [op.reaper_key for op in ops if op.reaper_key]
        if keys:
            with self._cond:
                for key in keys:
                    self._live.pop(key, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    while self._heap and self._heap[0][1] not in self._live:
                        heapq.heappop(self._heap)
                    delay = self._heap[0][0] - time.monotonic() if self._heap else None
                    if delay is not None and delay <= 0:
                        break
                    self._cond.wait(delay)
                if self._closed:
                    return
                op = self._live.pop(heapq.heappop(self._heap)[1])
            self._on_deadline(op)

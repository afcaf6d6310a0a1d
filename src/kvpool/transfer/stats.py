"""Plain counters the transfer engine fills; the Prometheus exporter reads them at scrape time."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


@dataclass
class TransferStats:
    """Cumulative counts of one engine (initiator side and served side)."""

    bytes: Counter = field(default_factory=Counter)  # (transport, direction) -> bytes
    requests: Counter = field(default_factory=Counter)  # (transport, direction) -> requests
    errors: Counter = field(default_factory=Counter)  # kind -> count
    served_bytes: Counter = field(default_factory=Counter)  # direction -> bytes (TCP server)
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    inflight_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def finished(self, entries: list[tuple[str, str, int, float, bool]]) -> None:
        """Requests completed, as ``(transport, direction, bytes, seconds, in_flight)``: count
        them (and take in-flight ones out of the in-flight total), under one lock."""
        with self._lock:
            for transport, direction, nbytes, seconds, inflight in entries:
                key = (transport, direction)
                self.bytes[key] += nbytes
                self.requests[key] += 1
                self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
                self.latency_sum += seconds
                if inflight:
                    self.inflight_bytes -= nbytes

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def served_batch(self, served: dict[str, int]) -> None:
        """Count a served train's bytes (per direction) and reset the caller's tallies."""
        with self._lock:
            for direction, nbytes in served.items():
                if nbytes:
                    self.served_bytes[direction] += nbytes
                    served[direction] = 0

    def add_inflight(self, nbytes: int) -> None:
        with self._lock:
            self.inflight_bytes += nbytes

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(
                Counter(self.bytes),
                Counter(self.requests),
                Counter(self.errors),
                Counter(self.served_bytes),
                list(self.latency_counts),
                self.latency_sum,
                self.inflight_bytes,
            )

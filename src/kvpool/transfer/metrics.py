"""Prometheus view of a transfer engine's ``TransferStats`` (read at scrape time)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvpool.transfer.stats import LATENCY_BUCKETS, TransferStats


class TransferStatsCollector(Collector):
    """Register with ``registry.register(TransferStatsCollector(engine.stats.snapshot))``."""

    def __init__(self, snapshot: Callable[[], TransferStats]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        nbytes = CounterMetricFamily(
            "kvpool_transfer_bytes",
            "Bytes moved by this engine's requests",
            labels=["transport", "direction"],
        )
        reqs = CounterMetricFamily(
            "kvpool_transfer_requests",
            "Transfer requests completed",
            labels=["transport", "direction"],
        )
        for (transport, direction), value in sorted(s.bytes.items()):
            nbytes.add_metric([transport, direction], value)
            reqs.add_metric([transport, direction], s.requests[(transport, direction)])
        served = CounterMetricFamily(
            "kvpool_transfer_served_bytes",
            "Bytes served to peers by the TCP server",
            labels=["direction"],
        )
        for direction, value in sorted(s.served_bytes.items()):
            served.add_metric([direction], value)
        errors = CounterMetricFamily(
            "kvpool_transfer_errors", "Failed transfers and refused frames", labels=["kind"]
        )
        for kind, value in sorted(s.errors.items()):
            errors.add_metric([kind], value)
        inflight = GaugeMetricFamily("kvpool_transfer_inflight_bytes", "Bytes in flight now")
        inflight.add_metric([], s.inflight_bytes)
        yield from (nbytes, reqs, served, errors, inflight, _latency(s))


def _latency(s: TransferStats) -> HistogramMetricFamily:
    buckets = []
    total = 0
    for bound, count in zip((*LATENCY_BUCKETS, float("inf")), s.latency_counts, strict=True):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
    hist = HistogramMetricFamily(
        "kvpool_transfer_latency_seconds", "Time from submit to completion per request"
    )
    hist.add_metric([], buckets, sum_value=s.latency_sum)
    return hist

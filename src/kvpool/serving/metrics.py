"""Prometheus exporter of one engine (names per DESIGN.md §3).

Cumulative engine counters and gauges are read from ``LLMEngine.stats()`` at scrape time by a
custom collector, so the engine's hot path does no metric work. Per-request histograms are
observed once, when a request finishes, from its ``RequestMetrics``. Each server gets its own
``CollectorRegistry`` so that several apps can live in one process (tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from kvpool.engine.llm_engine import EngineStats
from kvpool.engine.request import RequestOutput

logger = logging.getLogger(__name__)

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    80.0,
)
E2E_BUCKETS = (
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# (name without _total, help, EngineStats field)
_COUNTERS = (
    ("kvpool_prompt_tokens", "Prompt tokens received.", "prompt_tokens"),
    ("kvpool_generation_tokens", "Tokens generated.", "generation_tokens"),
    (
        "kvpool_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    (
        "kvpool_prefix_cache_hits",
        "Prompt tokens found in the prefix cache (local or pool).",
        "prefix_cache_hits",
    ),
    ("kvpool_num_preemptions", "Requests preempted for lack of KV blocks.", "num_preemptions"),
    ("kvpool_widened_steps",
     "Steps run on more torch threads than the worker's share: the cores of idle workers of "
     "the same host (kvpool serve's core sharing).", "widened_steps"),
)  # fmt: skip
_FETCH_SECONDS = (
    ("kvpool_kv_fetch_predicted_seconds", "Predicted waits of the prefix loads chosen.",
     "kv_fetch_predicted_seconds"),
    ("kvpool_kv_fetch_realized_seconds", "Realized waits of those loads (decision to runnable).",
     "kv_fetch_realized_seconds"),
)  # fmt: skip
_GAUGES = (
    ("kvpool_num_requests_running", "Requests in the running batch.", "num_running"),
    ("kvpool_num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("kvpool_kv_cache_usage_ratio", "Share of KV blocks held by requests (0..1).", "kv_usage"),
    ("kvpool_num_kv_blocks", "KV blocks in the engine's cache.", "num_kv_blocks"),
    ("kvpool_engine_threads", "Torch threads of the last step (0: the worker does not share "
     "cores).", "threads"),
)  # fmt: skip

# (name, help, DecodeFigures field): the roofline of the recent decode-only steps
_DECODE = (
    ("kvpool_decode_step_weight_bytes", "Weight bytes the last decode-only step read.",
     "weight_bytes"),
    ("kvpool_decode_step_kv_bytes", "KV bytes the last decode-only step read.", "kv_bytes"),
    ("kvpool_decode_batch_size", "Sequences in the last decode-only step.", "batch"),
    ("kvpool_decode_bandwidth_bytes_per_second",
     "Bytes read per second by recent decode-only steps (moving average).", "bytes_per_s"),
    ("kvpool_decode_tokens_per_second", "Tokens per second of recent decode-only steps.",
     "tokens_per_s"),
    ("kvpool_machine_read_bandwidth_bytes_per_second",
     "This machine's measured read bandwidth over a working set of the last decode step's bytes "
     "(faster than memory where they fit in its caches; kvpool roofline; absent until measured).",
     "limit_bytes_per_s"),
    ("kvpool_decode_bandwidth_share",
     "Decode bandwidth over the machine's read bandwidth (0..1).", "share"),
    ("kvpool_decode_ceiling_tokens_per_second",
     "Tokens/s the last decode step's batch would reach at the machine's read bandwidth.",
     "ceiling_tokens_per_s"),
)  # fmt: skip


class EngineStatsCollector(Collector):
    """Exports an ``EngineStats`` snapshot taken at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats()
        except Exception:  # a scrape must never take the server down
            logger.exception("reading engine stats failed")
            return
        for name, doc, field in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(s, field))
        fetch = CounterMetricFamily(
            "kvpool_kv_fetch_decisions",
            "Prefix loads decided: load, recompute (predicted faster), skip_lookup (too short "
            "to pay even as a full hit).",
            labels=["decision"],
        )
        fetch.add_metric(["load"], s.kv_fetch_loads)
        fetch.add_metric(["recompute"], s.kv_fetch_recomputes)
        fetch.add_metric(["skip_lookup"], s.kv_fetch_skipped)
        yield fetch
        yield CounterMetricFamily(
            "kvpool_kv_fetch_ties",
            "Of the load and recompute decisions, those between predictions within 1.25x of "
            "each other: the option taken less recently for that prefix size was taken.",
            value=s.kv_fetch_ties,
        )
        for name, doc, field in _FETCH_SECONDS:
            yield CounterMetricFamily(name, doc, value=getattr(s, field))
        for name, doc, field in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(s, field))
        if s.decode is not None:
            for name, doc, field in _DECODE:
                v = getattr(s.decode, field)
                if v is not None:
                    yield GaugeMetricFamily(name, doc, value=v)


class ServerMetrics:
    """The registry of one API server: engine stats plus per-request latencies."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(EngineStatsCollector(stats))
        self.request_success = Counter(
            "kvpool_request_success",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvpool_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvpool_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvpool_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )

    def observe_finished(self, out: RequestOutput) -> None:
        """Record a request that reached its final output."""
        self.request_success.labels(out.outputs[0].finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for dt in m.inter_token_latencies:
            self.itl.observe(dt)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def observe_aborted(self) -> None:
        """Record a request abandoned by its client before it finished."""
        self.request_success.labels("abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""``/metrics`` (Prometheus) and ``/health`` for the store's processes.

Collectors read plain stats at scrape time (no metric work on the hot path). One small
standard-library HTTP server per process, loopback by default.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

COUNTERS = ("puts", "gets", "hits", "misses", "evictions", "revokes", "lease_conflicts",
            "offloads", "promotions", "unconfirmed_commits")  # fmt: skip


class MasterCollector(Collector):
    """Store-wide figures from ``MasterService.stats()``."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield _gauge("kvpool_store_objects", "Objects in the pool", s.get("objects", 0))
        yield _gauge("kvpool_store_nodes", "Storage nodes mounted", s.get("nodes", 0))
        used = GaugeMetricFamily("kvpool_store_used_bytes", "Bytes allocated", labels=["tier"])
        cap = GaugeMetricFamily("kvpool_store_capacity_bytes", "Bytes mounted", labels=["tier"])
        for tier in ("dram", "ssd"):
            used.add_metric([tier], s.get(f"{tier}_used_bytes", 0))
            cap.add_metric([tier], s.get(f"{tier}_capacity_bytes", 0))
        yield used
        yield cap
        for name in COUNTERS:
            yield CounterMetricFamily(f"kvpool_store_{name}", f"Store {name}", s.get(name, 0))


class RpcCollector(Collector):
    """Calls, errors and handler latency of an ``RpcServer`` (``current()``, None: not serving)."""

    def __init__(self, current: Callable[[], object | None]) -> None:
        self._current = current

    def collect(self) -> Iterator[Metric]:
        server = self._current()
        if server is None:
            return
        stats = server.stats
        for name in ("calls", "errors", "malformed", "auth_failures", "dropped"):
            yield CounterMetricFamily(f"kvpool_rpc_{name}", f"RPC {name}", stats.get(name, 0))
        buckets, total = server.latency.buckets()
        hist = HistogramMetricFamily("kvpool_rpc_latency_seconds", "RPC handler time per call")
        hist.add_metric([], buckets, sum_value=total)
        yield hist


class NodeCollector(Collector):
    """One storage node's contents."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield _gauge("kvpool_store_node_objects", "Objects this node holds", s["objects"])
        yield _gauge("kvpool_store_node_bytes", "Bytes of objects this node holds", s["bytes"])
        yield _gauge("kvpool_store_node_capacity_bytes", "Memory this node offers", s["capacity"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


class MetricsServer:
    """Serves ``/metrics`` from ``collectors`` and ``/health`` from ``health()`` (a dict with
    ``"status": "ok"`` or anything else, which answers 503)."""

    def __init__(
        self,
        collectors: list[Collector],
        health: Callable[[], dict],
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        registry = CollectorRegistry()
        for c in collectors:
            registry.register(c)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args) -> None:  # quiet
                return

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
                elif self.path == "/health":
                    h = health()
                    body, ctype = json.dumps(h).encode(), "application/json"
                    code = 200 if h.get("status") == "ok" else 503
                else:
                    body, ctype, code = b'{"error": "not found"}', "application/json", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

"""The shipped Grafana dashboard only queries metrics kvpool exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvpool.conductor.cluster import ClusterState
from kvpool.conductor.metrics import ConductorMetrics

ROOT = Path(__file__).resolve().parents[2]


def exported_names() -> set[str]:
    text = ConductorMetrics(ClusterState([])).render().decode()
    names = set(re.findall(r"^(kvpool_\w+)", text, re.M))
    for path in (ROOT / "src/kvpool").rglob("*metrics.py"):  # store, transfer, serving
        names |= set(re.findall(r'"(kvpool_\w+)"', path.read_text()))
    return names


def test_dashboard_queries_exported_metrics():
    dash = json.loads((ROOT / "docs/grafana/kvpool-dashboard.json").read_text())
    exported = exported_names()
    queried = {
        m
        for panel in dash["panels"]
        for t in panel["targets"]
        for m in re.findall(r"kvpool_\w+", t["expr"])
    }
    assert len(queried) >= 15
    missing = {
        m
        for m in queried
        if m not in exported and re.sub(r"_(bucket|total|count|sum)$", "", m) not in exported
    }
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"

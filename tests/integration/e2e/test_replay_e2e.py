"""`kvpool bench replay` of the first 50 requests of the real conversation trace, scaled,
against `kvpool serve`: a report with non-zero prefix hits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.procs import kvpool_cmd, serve

from kvpool.bench.launch import MEASURE_FLAGS

pytestmark = pytest.mark.slow
TRACE = Path(__file__).resolve().parents[2] / "data/conversation_trace_head.jsonl"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("replay") / "serve.log"
    yield from serve(log, "--kv-cache-memory", "512MiB", "--store-memory", "512MiB",
                     *MEASURE_FLAGS)  # fmt: skip


def test_replay_the_conversation_trace(cluster, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [*kvpool_cmd(), "bench", "replay", "--trace", str(TRACE), "--endpoint", cluster[1],
         "--limit", "50", "--block-tokens", "16", "--max-input", "256", "--max-output", "8",
         "--time-scale", "2", "--slo-ttft", "30", "--slo-tbt", "2", "--out", str(out),
         "--no-progress", "--budget", "400"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    s = doc["summary"]
    assert s["num_requests"] == 50 and s["completed"] == 50, s
    assert s["prefix_hit_rate"] > 0  # block 0 is the trace's shared system prompt
    assert s["median_ttft_s"] > 0 and s["p99_tbt_s"] is not None
    assert 0 < s["effective_capacity_tbt_1s"] <= 1 and "effective_capacity_tbt_0.2s" in s
    assert doc["meta"]["offline_prefix_hit_ratio_trace"] > 0
    rows = (out / "requests.csv").read_text().splitlines()
    assert len(rows) == 51
    html = (out / "report.html").read_text()
    for png in ("cdf_ttft_tbt.png", "over_time.png", "capacity_vs_tbt.png"):
        assert png in html and (out / png).stat().st_size > 1000


def test_replay_reports_an_unreachable_endpoint(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 32, "output_length": 4, "hash_ids": [1]}\n'
                   "not json\n")  # fmt: skip
    proc = subprocess.run(
        [*kvpool_cmd(), "bench", "replay", "--trace", str(bad), "--endpoint",
         "http://127.0.0.1:9", "--out", str(tmp_path / "o"), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "line 2: invalid JSON" in proc.stderr and "failed" in proc.stderr
    strict = subprocess.run(
        [*kvpool_cmd(), "bench", "replay", "--trace", str(bad), "--endpoint",
         "http://127.0.0.1:9", "--out", str(tmp_path / "o"), "--strict"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert strict.returncode == 2 and "1 malformed line" in strict.stderr

"""The replay's metric math against hand-computed examples."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.metrics import RequestRecord, percentile, summarize, tbt_of
from kvpool.bench.report import write_report


def rec(i, times, status="ok", prompt=100, cached=0, out=None, end=None):
    r = RequestRecord(i, 0.0, float(i), status=status, prompt_tokens=prompt, cached_tokens=cached)
    r.token_times = list(times)
    r.output_tokens = len(times) if out is None else out
    r.end_s = end if end is not None else (times[-1] if times else 0.0)
    return r


def test_tbt_is_the_mean_of_the_longest_tenth_of_gaps():
    assert tbt_of([]) is None
    assert tbt_of([0.1, 0.3, 0.2]) == pytest.approx(0.3)  # ceil(0.3) = 1 gap
    gaps = [0.1] * 18 + [0.5, 0.7]  # 20 gaps: the longest 2
    assert tbt_of(gaps) == pytest.approx(0.6)


def test_request_figures():
    r = rec(0, [0.5, 0.6, 0.8, 1.1])
    assert r.ttft == 0.5
    assert r.gaps == pytest.approx([0.1, 0.2, 0.3])
    assert r.tbt == pytest.approx(0.3)
    assert r.tpot == pytest.approx(0.2)  # (1.1 - 0.5) / 3
    assert rec(1, [0.4]).tpot is None


def test_percentiles_interpolate():
    assert percentile([], 50) is None
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([0, 10], 90) == 9.0
    assert percentile([7], 99) == 7


def test_summary_goodput_capacity_hit_and_rejection_rates():
    records = [
        rec(0, [0.2, 0.28, 0.36], cached=50),  # TTFT 0.2, TBT 0.08
        rec(1, [1.0, 1.5, 2.0], cached=0),  # TTFT 1.0, TBT 0.5
        rec(2, [3.0, 3.1], cached=100),  # TTFT 3.0 (breaks the 2 s SLO)
        rec(3, [], status="rejected", prompt=0),
    ]
    s = summarize(records, duration_s=10.0, slo_ttft=2.0, slo_tbt=0.2,
                  tbt_thresholds=(0.1, 0.5, 1.0))  # fmt: skip
    assert s["completed"] == 3 and s["rejected"] == 1 and s["failed"] == 0
    assert s["request_throughput"] == pytest.approx(0.3)
    assert s["output_throughput"] == pytest.approx(0.8)  # 8 tokens / 10 s
    assert s["median_tbt_s"] == pytest.approx(0.1)  # TBTs 0.08, 0.5, 0.1
    assert s["prefix_hit_rate"] == pytest.approx(150 / 300)
    assert s["rejection_rate"] == 0.25
    assert s["request_goodput"] == pytest.approx(0.1)  # only request 0 meets both SLOs
    assert s["goodput_ratio"] == 0.25
    assert s["effective_capacity_tbt_0.1s"] == 0.25
    assert s["effective_capacity_tbt_0.5s"] == 0.5  # 0 and 1; 2 breaks the TTFT SLO
    assert s["median_ttft_s"] == pytest.approx(1.0)
    assert s["mean_e2e_s"] == pytest.approx((0.36 + 2.0 + 3.1) / 3)


def test_report_files(tmp_path):
    records = [rec(0, [0.2, 0.28, 0.36], cached=50), rec(1, [], status="error", prompt=0)]
    s = summarize(records, 5.0, 1.0, 0.5)
    path = write_report(tmp_path, {"a": (records, s), "b": (records, s)}, {"slo_ttft_s": 1.0})
    assert path.name == "report.html"
    html = path.read_text()
    for png in ("cdf_ttft_tbt.png", "over_time.png", "capacity_vs_tbt.png"):
        assert (tmp_path / png).stat().st_size > 1000 and png in html
    doc = json.loads((tmp_path / "results.json").read_text())
    assert set(doc["systems"]) == {"a", "b"}
    assert doc["systems"]["a"]["summary"]["prefix_hit_rate"] == pytest.approx(0.5)
    assert set(doc["summary"]) == {"a", "b"}
    rows = (tmp_path / "requests.csv").read_text().splitlines()
    assert len(rows) == 1 + 4 and rows[0].startswith("system,index")
    assert "token_times_s" in rows[0] and "0.2000 0.2800 0.3600" in rows[1]


def test_text_prompts_keep_blocks_stable():
    from kvpool.bench.replay import text_prompt

    a = text_prompt((1, 2, 3, 4, 5, 6), 3)
    b = text_prompt((1, 2, 3, 9, 9, 9), 3)
    assert a.count("\n") == 1 and a.split("\n")[0] == b.split("\n")[0]
    assert a.split("\n")[1] != b.split("\n")[1]
    assert text_prompt((1, 2, 3), 3) == a.split("\n")[0]

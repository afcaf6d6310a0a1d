"""``kvpool sim`` on a slice of the real trace: the report files, the systems, bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.sim.systems import parse_policies

HEAD_TRACE = Path(__file__).resolve().parents[1] / "data/conversation_trace_head.jsonl"


def test_a_slice_writes_the_report(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["sim", "--trace", str(HEAD_TRACE), "--limit", "40", "--prefill", "2",
               "--decode", "2", "--policy", "cache_aware,random:nopool", "--with-colocated",
               "4", "--chunked-prefill", "on", "--capacity", "0.5,4", "--slo-ttft", "30",
               "--slo-tbt", "0.5", "--no-admission", "--out", str(out),
               "--no-progress"])  # fmt: skip
    assert rc == 0
    said = capsys.readouterr().out
    assert "cache_aware: 40/40 ok" in said and "effective capacity (req/s)" in said
    for name in ("results.json", "requests.csv", "report.html", "sim.json", "simulation.html",
                 "ttft_by_policy.png", "hit_rate_over_time.png", "queues.png", "node_load.png",
                 "effective_capacity.png", "cdf_ttft_tbt.png", "capacity_vs_tbt.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    doc = json.loads((out / "results.json").read_text())
    systems = ["cache_aware", "random:nopool", "colocated-chunked/least_load"]
    assert list(doc["systems"]) == systems
    s = doc["systems"]["cache_aware"]["summary"]
    for key in ("median_ttft_s", "p99_tbt_s", "prefix_hit_rate", "effective_capacity_tbt_0.1s",
                "sim_predicted_hit_rate", "sim_route_as_predicted", "sim_pool_puts"):  # fmt: skip
        assert key in s, key
    assert s["completed"] == 40 and s["slo_ttft_s"] == 30
    assert "Profile assumptions" in (out / "simulation.html").read_text()
    assert "sim_pool_puts" not in doc["systems"]["random:nopool"]["summary"]
    sim = json.loads((out / "sim.json").read_text())
    assert sim["capacity"]["factors"] == [0.5, 4.0]
    assert set(sim["capacity"]["capacity"]) == set(systems)
    assert len(sim["systems"]["cache_aware"]["nodes"]) == 4
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 40
    wanted = {"predicted_hit_tokens", "realized_hit_tokens", "route_outcome", "ttft_s"}
    assert wanted <= set(rows[0])


def test_colocated_only_and_bad_input(tmp_path, capsys):
    args = ["sim", "--trace", str(HEAD_TRACE), "--limit", "10", "--no-progress"]
    assert main([*args, "--colocated", "3", "--chunked-prefill", "off", "--policy",
                 "least_load", "--out", str(tmp_path / "c")]) == 0  # fmt: skip
    doc = json.loads((tmp_path / "c" / "results.json").read_text())
    assert list(doc["systems"]) == ["colocated/least_load"]
    assert main([*args, "--profile", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "no profile named 'nope'" in capsys.readouterr().err
    assert main([*args, "--policy", "fastest", "--out", str(tmp_path / "x")]) == 2
    assert "unknown policy 'fastest'" in capsys.readouterr().err
    assert main([*args, "--prefill", "0", "--out", str(tmp_path / "x")]) == 2
    assert "needs >= 1 prefill" in capsys.readouterr().err
    assert main(["sim", "--trace", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "--out", str(tmp_path)])  # no --trace
    with pytest.raises(SystemExit):
        main([*args, "--capacity", "1,-2", "--out", str(tmp_path)])


def test_policy_lists_and_the_pool():
    assert parse_policies("cache_aware,local,least_load,random", "auto", False) == [
        ("cache_aware", True), ("local", False), ("least_load", True), ("random", True)]  # fmt: skip
    assert parse_policies("least_load:nopool, local:pool", "auto", False) == [
        ("least_load", False), ("local", True)]  # fmt: skip
    assert parse_policies("cache_aware", "off", False) == [("cache_aware", False)]
    assert parse_policies("least_load", "auto", True) == [("least_load", False)]
    with pytest.raises(ValueError, match="suffix"):
        parse_policies("local:maybe", "auto", False)
    with pytest.raises(ValueError, match="no policy"):
        parse_policies(",", "auto", False)


def test_capacity_is_where_the_share_crosses_the_quantile():
    from kvpool.sim.capacity import crossing

    pts = [{"rate_per_s": r, "share": {"0.1": s}} for r, s in ((1.0, 1.0), (2.0, 0.95),
                                                              (4.0, 0.75), (8.0, 0.2))]  # fmt: skip
    assert crossing(pts, "0.1", 0.9) == pytest.approx(2.0 + 0.05 / 0.2 * 2.0)  # 2.5 req/s
    assert crossing(pts, "0.1", 0.1) == 8.0  # every rate passes: the highest tested
    assert crossing(pts, "0.1", 1.01) == 0.0

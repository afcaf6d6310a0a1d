"""Trace loading and scaling: sharing preserved, malformed lines reported with their number."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvpool.bench.trace import (
    ScaleConfig,
    TraceError,
    load_trace,
    prefix_hit_ratio_tokens,
    prefix_hit_ratio_trace,
    scale,
)

REAL = Path(__file__).resolve().parents[1] / "data/conversation_trace_head.jsonl"


def write(tmp_path: Path, lines: list) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def req(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_equal_ids_become_equal_blocks_and_different_ids_different(tmp_path):
    path = write(tmp_path, [req(0, 1024, 100, [0, 1]), req(10, 1500, 50, [0, 1, 2]),
                            req(20, 1024, 10, [0, 3])])  # fmt: skip
    r = scale(load_trace(path).requests, ScaleConfig(block_tokens=8))
    a, b, c = (x.prompt for x in r)
    assert len(a) == 16 and len(b) == 23 and len(c) == 16  # 1500 * 8 / 512 = 23.4
    assert a == b[:16]  # blocks 0 and 1 shared
    assert a[:8] == c[:8] and a[8:] != c[8:]  # block 0 shared, then different ids
    assert [x.output_length for x in r] == [2, 1, 1]  # 100, 50, 10 tokens * 8 / 512, >= 1
    again = scale(load_trace(path).requests, ScaleConfig(block_tokens=8))
    assert [x.prompt for x in again] == [a, b, c]  # deterministic
    other_seed = scale(load_trace(path).requests, ScaleConfig(block_tokens=8, seed=1))
    assert other_seed[0].prompt != a


def test_time_scaling_rate_caps_limit_and_window(tmp_path):
    path = write(tmp_path, [req(t * 1000, 600, 600, [t, 100 + t]) for t in range(10)])
    reqs = load_trace(path).requests
    r = scale(reqs, ScaleConfig(time_scale=0.5, max_input=10, max_output=3))
    assert [x.arrival_s for x in r] == [t * 0.5 for t in range(10)]
    assert all(len(x.prompt) == 10 and x.output_length == 3 for x in r)
    assert len(scale(reqs, ScaleConfig(limit=4))) == 4
    assert len(scale(reqs, ScaleConfig(window=3.5))) == 4  # arrivals 0, 1, 2, 3
    poisson = scale(reqs, ScaleConfig(rate=100.0, seed=3))
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(poisson)]
    assert all(g > 0 for g in gaps) and sum(gaps) / len(gaps) < 0.05
    with pytest.raises(ValueError):
        ScaleConfig(block_tokens=0)
    with pytest.raises(ValueError):
        ScaleConfig(rate=-1)


def test_malformed_lines_are_reported_with_their_number(tmp_path):
    path = write(tmp_path, [
        req(0, 100, 10, [0]),
        "{not json",
        req(1, 0, 10, [0]),
        {"timestamp": 2, "input_length": 10},
        req(3, 10, 10, []),
        req(-1, 10, 10, [1]),
        req(4, 10, 10, ["a"]),
        "[1, 2]",
        "",
        req(5, 10, 10, [2]),
    ])  # fmt: skip
    report = load_trace(path)
    assert [r.line for r in report.requests] == [1, 10]
    assert [e.split(":")[0] for e in report.errors] == [f"line {n}" for n in (2, 3, 4, 5, 6, 7, 8)]
    assert "missing output_length, hash_ids" in report.errors[2]
    with pytest.raises(TraceError, match="7 malformed line"):
        load_trace(path, strict=True)
    with pytest.raises(TraceError, match="no usable request"):
        load_trace(write(tmp_path, ["garbage"]))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_scaled_real_trace_keeps_the_prefix_hit_ratio_within_one_point():
    reqs = load_trace(REAL).requests  # the first 1,000 requests
    original = prefix_hit_ratio_trace(reqs)
    for bt in (16, 32):
        scaled = prefix_hit_ratio_tokens([r.prompt for r in scale(reqs, ScaleConfig(bt))], bt)
        assert abs(scaled - original) < 0.01, (bt, scaled, original)
    assert 0.2 < original < 0.5
    capped = scale(reqs, ScaleConfig(16, max_input=256))  # the cap truncates long prompts
    got = prefix_hit_ratio_tokens([r.prompt for r in capped], 16)
    assert abs(got - prefix_hit_ratio_trace(reqs, max_tokens=256 * 512 // 16)) < 0.01


def test_offline_hit_ratio_by_hand(tmp_path):
    # 2 requests: 1024 tokens [0, 1], then 1024 tokens [0, 2] -> 512 of 2048 tokens hit
    path = write(tmp_path, [req(0, 1024, 1, [0, 1]), req(1, 1024, 1, [0, 2])])
    reqs = load_trace(path).requests
    assert prefix_hit_ratio_trace(reqs) == pytest.approx(0.25)
    assert prefix_hit_ratio_tokens([r.prompt for r in scale(reqs, ScaleConfig(4))], 4) == 0.25


ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_trace_is_whole_and_no_doc_points_outside_the_repository():
    """``data/traces/`` holds the full conversation trace the README's examples replay (a
    fresh clone has no ``../shared``)."""
    report = load_trace(ROOT / "data/traces/conversation_trace.jsonl", strict=True)
    reqs = report.requests
    assert len(reqs) == 12031 and not report.errors
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in reqs)
    assert all(r.hash_ids[0] == reqs[0].hash_ids[0] for r in reqs)  # the common first block
    for doc in ("README.md", "docs/operations.md", "docs/benchmarks.md"):
        assert "shared/traces" not in (ROOT / doc).read_text(), doc

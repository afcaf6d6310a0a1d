"""The simulator's workload matches ``bench replay``'s scaling; profiles load, validate and
cost what their figures say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simkit import HEAD, LIN, PAIR, TOY_MODEL, step, toy_profile

from kvpool.bench.trace import ScaleConfig, load_trace, scale
from kvpool.sim.cost import StepCost, conductor_cost
from kvpool.sim.profile import ProfileError, builtin_profiles, load_profile, profile_from_dict
from kvpool.sim.workload import BlockNames, scale_requests, usable_blocks, workload_facts

HEAD_TRACE = Path(__file__).resolve().parents[1] / "data/conversation_trace_head.jsonl"


@pytest.mark.parametrize("kw", [
    {"block_tokens": 16, "max_input": 384, "max_output": 24, "time_scale": 5, "limit": 60},
    {"block_tokens": 8, "rate": 3.0, "limit": 40, "seed": 3},
    {"block_tokens": 512, "window": 30.0},
])  # fmt: skip
def test_scaling_matches_bench_replay(kw):
    trace = load_trace(HEAD_TRACE).requests
    cfg = ScaleConfig(**kw)
    ours, theirs = scale_requests(trace, cfg), scale(trace, cfg)
    assert len(ours) == len(theirs) > 5
    names = BlockNames()
    for a, b in zip(ours, theirs, strict=True):
        assert (a.index, a.arrival_s, a.input_tokens, a.output_tokens) == \
            (b.index, b.arrival_s, len(b.prompt), b.output_length)  # fmt: skip
        n = usable_blocks(a.input_tokens, cfg.block_tokens)
        assert a.hashes == tuple(names(h) for h in b.hash_ids[:n])


def test_workload_facts():
    reqs = scale_requests(load_trace(HEAD_TRACE).requests, ScaleConfig(block_tokens=512))
    f = workload_facts(reqs, 512)
    assert f["requests"] == len(reqs) and 0 < f["offline_prefix_hit_ratio"] < 1
    assert f["span_s"] == reqs[-1].arrival_s


def test_a800_profile_figures():
    assert "a800-llama" in builtin_profiles()
    p = load_profile("a800-llama")
    assert p.model.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # 327,680 B (LLaMA2-70B, GQA)
    assert p.node.flops_per_s == 8 * 312e12 and p.node.mem_bytes_per_s == 8 * 2.039e12
    assert p.model.step_weight_bytes == pytest.approx(137.4e9, rel=1e-3)
    assert len(p.sources) >= 3 and len(p.assumptions) >= 3
    cost = StepCost(p)
    # a decode step of one short sequence reads the weights: 137.4 GB at 70 % of 16.3 TB/s
    assert cost.decode_s(1, 100) == pytest.approx(0.003 + 2e-5 + 137.4e9 / (0.7 * 1.6312e13),
                                                  rel=1e-2)  # fmt: skip
    # an 8k prompt is compute-bound: 2 * 68.45e9 * 8192 FLOPs + attention at half the peak
    flops = 2 * 80 * p.model.layer_params * 8192 + 4 * 80 * 64 * 128 * 8192 * 8193 / 2
    assert cost.prefill_s(8192) == pytest.approx(0.003 + (flops + 2 * 8192 * 32000)
                                                 / (0.5 * 2.496e15), rel=1e-6)  # fmt: skip


def test_step_cost_is_the_documented_formula():
    cost = StepCost(toy_profile())
    assert TOY_MODEL.linear_flops_per_token == 224 and TOY_MODEL.lm_head_flops == 224
    assert (cost.lin, cost.head, cost.attn) == pytest.approx((LIN, HEAD, PAIR))
    assert cost.step_s(7, 30, 5, 2, 3, 40) == pytest.approx(step(7, 30, 5, 2, 3, 40))
    overlapped = StepCost(toy_profile(overlap=True))
    compute = LIN * 10 + HEAD + PAIR * 55
    assert overlapped.prefill_s(10) == pytest.approx(0.01 + max(compute, 0.001))


def test_conductor_cost_is_a_linear_fit_of_the_true_costs():
    p = toy_profile()
    cm = conductor_cost(StepCost(p), [8, 16, 32, 64, 128], 20.0, 8, 64)
    assert cm.prefill_token_s > LIN  # attention makes the line steeper than the layers alone
    true = StepCost(p).prefill_s(64)
    assert cm.prefill_s(64) == pytest.approx(true, rel=0.5)  # a line through a parabola
    assert cm.decode_step_s(4) == pytest.approx(StepCost(p).decode_s(4, 80), rel=0.05)


def test_bad_profiles_say_what_is_wrong(tmp_path):
    with pytest.raises(ProfileError, match="no profile named"):
        load_profile("h100-imaginary")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="invalid JSON"):
        load_profile(bad)
    doc = json.loads((Path(load_profile.__code__.co_filename).parent / "profiles" /
                      "a800-llama.json").read_text())  # fmt: skip
    doc["node"]["mfu"] = 1.5
    with pytest.raises(ProfileError, match="mfu must be <= 1"):
        profile_from_dict(doc)
    doc["node"]["mfu"], doc["node"]["warp_drive"] = 0.5, True
    with pytest.raises(ProfileError, match="unknown field"):
        profile_from_dict(doc)
    del doc["node"]["warp_drive"], doc["pool"]
    with pytest.raises(ProfileError, match="missing section 'pool'"):
        profile_from_dict(doc)
    with pytest.raises(ProfileError, match="num_layers must be a number > 0"):
        profile_from_dict({**json.loads(json.dumps(doc)), "pool": {"blocks_per_node": 1},
                           "model": {**doc["model"], "num_layers": 0}})  # fmt: skip


def test_sim_records_write_the_bench_rows():
    from kvpool.bench.metrics import RequestRecord
    from kvpool.sim.results import SimRecord

    times = [0.5, 0.6, 0.9, 1.0]
    ours = SimRecord(3, 1.0, 1.0, "ok", 200, 10, 8, 4, 4, list(times), 1.0,
                     predicted_hit_tokens=8, route_outcome="as_predicted")  # fmt: skip
    base = RequestRecord(3, 1.0, 1.0, "ok", 200, 10, 8, 4, 4, list(times), 1.0)
    row, want = ours.to_row(), base.to_row()
    assert {k: row[k] for k in want} == want
    assert row["predicted_hit_tokens"] == 8 and "memo" not in row and "token_times" not in row
    assert ours.tbt == base.tbt == pytest.approx(0.3) and ours.gaps == base.gaps

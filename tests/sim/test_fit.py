"""The calibration's fit, on synthetic step timings made by the cost model it inverts."""

from __future__ import annotations

import random

import pytest

from kvpool.sim.cost import StepCost, causal_pairs
from kvpool.sim.fit import StepSample, fit_steps
from kvpool.sim.profile import ModelSpec, NetworkSpec, NodeSpec, PoolSpec, Profile

SMOL = ModelSpec("smol-like", num_layers=30, hidden_size=576, intermediate_size=1536,
                 num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152, kv_dtype_bytes=4,
                 weight_bytes=120e6)  # fmt: skip
TRUE = {"flops_per_s": 80e9, "mfu": 0.5, "attn_mfu": 0.25, "mem_bytes_per_s": 12e9,
        "mem_efficiency": 1.0, "overlap": False, "step_base_s": 0.004,
        "decode_seq_s": 0.0003}  # fmt: skip


def samples(noise: float = 0.0, seed: int = 0) -> list[StepSample]:
    cost = StepCost(Profile("t", SMOL, NodeSpec(**TRUE), NetworkSpec(1e9), PoolSpec(10), 16))
    rng = random.Random(seed)
    out = []
    for n, p in [(32, 0), (128, 0), (256, 0), (512, 0), (1024, 0), (64, 512), (256, 512),
                 (512, 1024)]:  # fmt: skip
        t = cost.step_s(n, causal_pairs(n, p), p, 1)
        out.append(StepSample(n, p, seconds=t * (1 + rng.uniform(-noise, noise))))
    for b in (1, 2, 4, 8, 16, 32):
        for c in (64, 512):
            t = cost.decode_s(b, b * c)
            out.append(StepSample(decodes=b, decode_context=b * c,
                                  seconds=t * (1 + rng.uniform(-noise, noise))))  # fmt: skip
    return out


def test_exact_timings_give_back_the_figures():
    fit = fit_steps(SMOL, samples(), weight_bytes=120e6)
    assert fit.linear_flops_per_s == pytest.approx(40e9, rel=1e-6)  # 80e9 * 0.5
    assert fit.attention_flops_per_s == pytest.approx(20e9, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(12e9, rel=1e-6)
    assert fit.step_base_s == pytest.approx(0.004, rel=1e-6)
    assert fit.decode_seq_s == pytest.approx(0.0003, rel=1e-6)
    assert fit.weight_bytes == pytest.approx(120e6) and fit.r2 == pytest.approx(1.0)
    assert fit.max_rel_error < 1e-9 and fit.dropped == ()
    node = NodeSpec(**fit.node_fields())  # a valid profile section
    assert node.flops_per_s * node.mfu == pytest.approx(40e9, rel=1e-6)
    assert node.flops_per_s * node.attn_mfu == pytest.approx(20e9, rel=1e-6)


def fitted_cost(fit) -> StepCost:
    model = ModelSpec(**{**{f: getattr(SMOL, f) for f in SMOL.__slots__},
                         "weight_bytes": fit.weight_bytes})  # fmt: skip
    return StepCost(Profile("f", model, NodeSpec(**fit.node_fields()), NetworkSpec(1e9),
                            PoolSpec(10), 16))  # fmt: skip


def test_noisy_timings_predict_steps_closely():
    fit = fit_steps(SMOL, samples(noise=0.03, seed=1), weight_bytes=120e6)
    assert fit.linear_flops_per_s == pytest.approx(40e9, rel=0.1)
    assert fit.r2 > 0.99 and fit.max_rel_error < 0.1
    # attention and KV reads both grow with the context: noise may trade one for the other,
    # but the steps they make stay within a few percent of the truth
    true = StepCost(Profile("t", SMOL, NodeSpec(**TRUE), NetworkSpec(1e9), PoolSpec(10), 16))
    got = fitted_cost(fit)
    for n, p in [(100, 0), (700, 0), (200, 300), (400, 800)]:
        assert got.prefill_s(n, p) == pytest.approx(true.prefill_s(n, p), rel=0.05)
    for b, c in [(3, 100), (12, 300), (24, 600)]:
        assert got.decode_s(b, b * c) == pytest.approx(true.decode_s(b, b * c), rel=0.05)


def test_weights_larger_than_the_intercept_allows_are_capped():
    # the model says 1 GB of weights, but the steps' fixed part is only 0.014 s at 12 GB/s:
    # the fit keeps what the timings show (168 MB) and no negative fixed cost
    fit = fit_steps(SMOL, samples(), weight_bytes=1e9)
    assert fit.step_base_s == 0.0
    assert fit.weight_bytes == pytest.approx(0.004 * 12e9 + 120e6, rel=1e-6)


def test_a_term_with_no_positive_cost_is_dropped():
    flat = [StepSample(s.prefill_tokens, 0, s.decodes, 0, s.seconds) for s in samples()
            if s.prefill_context == 0 and s.decode_context <= 64 * s.decodes]  # fmt: skip
    # no context varies apart from attention within a prompt: no memory term to see
    fit = fit_steps(SMOL, [StepSample(s.prefill_tokens, 0, s.decodes, 0, s.seconds)
                           for s in flat], 120e6)  # fmt: skip
    assert "kv_bytes" in fit.dropped and fit.bytes_per_s > 1e15


def test_too_few_kinds_of_samples_are_refused():
    only_prefill = [s for s in samples() if s.prefill_tokens]
    with pytest.raises(ValueError, match="decode steps of >= 2 batch sizes"):
        fit_steps(SMOL, only_prefill, 1e6)
    bad = [*samples()[:-1], StepSample(decodes=3, decode_context=9, seconds=0.0)]
    with pytest.raises(ValueError, match="positive"):
        fit_steps(SMOL, bad, 1e6)

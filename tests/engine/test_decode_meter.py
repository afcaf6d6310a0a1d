"""The engine's live decode roofline figures (engine/decode_meter.py)."""

import pytest
import torch

from kvpool.engine.decode_meter import ALPHA, DecodeMeter
from kvpool.model.llama import LlamaModel
from kvpool.model.machine import MachineLimits
from kvpool.model.step_cost import kv_bytes_per_token, step_cost


@pytest.fixture
def model(tiny_model):
    return LlamaModel(tiny_model.config, tiny_model.weights, torch.float32, "float32")


def test_figures_of_a_step_and_their_moving_average(model):
    limits = MachineLimits("test", 2, read_gbps=10.0, copy_gbps=8.0, gemm_gflops=50.0)
    meter = DecodeMeter(model, limits)
    assert meter.figures is None
    weights = step_cost(model, 2, 0).weight_bytes
    kv = 100 * kv_bytes_per_token(model)
    meter.observe(2, 100, 0.01)
    f = meter.figures
    assert (f.batch, f.weight_bytes, f.kv_bytes) == (2, weights, kv)
    assert f.bytes_per_s == pytest.approx((weights + kv) / 0.01)
    assert f.tokens_per_s == pytest.approx(200.0)
    assert f.share == pytest.approx(f.bytes_per_s / 10e9)
    assert f.ceiling_tokens_per_s == pytest.approx(2 * 10e9 / (weights + kv))
    meter.observe(2, 100, 0.02)  # half the rate: the average moves by ALPHA of the gap
    assert meter.figures.tokens_per_s == pytest.approx(200 - ALPHA * 100)
    meter.observe(0, 0, 0.01)  # not a decode step: ignored
    assert meter.steps == 2


def test_a_step_that_fits_in_the_caches_is_measured_against_their_bandwidth(model):
    weights = step_cost(model, 1, 0).weight_bytes
    kv = 10 * kv_bytes_per_token(model)
    # reads of a working set up to twice the step's bytes run at 40 GB/s, from memory at 10
    curve = {2 * (weights + kv): 40.0, 100 * (weights + kv): 12.0}
    limits = MachineLimits("test", 2, 10.0, 8.0, 50.0, read_curve=curve)
    meter = DecodeMeter(model, limits)
    meter.observe(1, 10, 0.001)
    f = meter.figures
    assert f.limit_bytes_per_s == pytest.approx(40e9)
    assert f.share == pytest.approx(f.bytes_per_s / 40e9)


def test_without_known_limits_only_achieved_figures(model):
    meter = DecodeMeter(model, None)
    meter.observe(1, 10, 0.005)
    f = meter.figures
    assert f.bytes_per_s > 0 and f.limit_bytes_per_s is None and f.share is None
    assert f.ceiling_tokens_per_s is None

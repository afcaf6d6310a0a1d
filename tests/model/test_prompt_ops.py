"""The prompt path's RoPE and MLP activation in C++ (kernels/decode.cpp: ``rope_rows_``,
``silu_mul_rows``) against the torch ops they replace (model/llama.py), and their checks."""

import pytest
import torch
import torch.nn.functional as F

from kvpool.model.kernels import kernels
from kvpool.model.llama import LlamaModel

kern = kernels()
pytestmark = pytest.mark.skipif(kern is None, reason="no C++ compiler for the kernels")

HEADS, KV_HEADS, D, INTER = 4, 2, 16, 48


def _model(positions=64):
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(positions, D, generator=g) * 6.0
    cos, sin = angles.cos(), angles.sin()
    return kern.DecodeModel(HEADS, KV_HEADS, D, INTER, 1e-5, cos, sin, torch.ones(8)), cos, sin


@pytest.mark.parametrize("rows", [1, 7, 40])  # one row; fewer and more than a thread's share
def test_rope_rows_rotates_q_and_k_in_place_like_the_torch_path(rows):
    fused, cos, sin = _model()
    width = (HEADS + 2 * KV_HEADS) * D
    qkv = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    positions = torch.randint(0, 64, (rows,), generator=torch.Generator().manual_seed(1))
    rotated = (HEADS + KV_HEADS) * D
    want = LlamaModel._rope(qkv[:, :rotated].view(rows, HEADS + KV_HEADS, D),
                            cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))  # fmt: skip
    v = qkv[:, rotated:].clone()
    fused.rope_rows_(qkv, positions)
    assert torch.allclose(qkv[:, :rotated].view_as(want), want, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, rotated:], v)  # values are not rotated


def test_rope_rows_refuses_bad_tensors():
    fused, _, _ = _model(positions=8)
    qkv = torch.zeros(2, (HEADS + 2 * KV_HEADS) * D)
    with pytest.raises(RuntimeError, match="position out of range"):
        fused.rope_rows_(qkv, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="positions must be"):
        fused.rope_rows_(qkv, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="qkv must be"):
        fused.rope_rows_(torch.zeros(2, D), torch.tensor([0, 1]))


@pytest.mark.parametrize("rows", [1, 9, 33])
def test_silu_mul_rows_is_silu_of_the_gate_times_up(rows):
    fused, _, _ = _model()
    gu = torch.randn(rows, 2 * INTER, generator=torch.Generator().manual_seed(rows)) * 4
    want = F.silu(gu[:, :INTER]) * gu[:, INTER:]
    got = fused.silu_mul_rows(gu)
    assert got.shape == (rows, INTER)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="gu must be"):
        fused.silu_mul_rows(torch.zeros(rows, INTER))

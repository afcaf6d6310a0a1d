"""int8 KV rows (model/kv_quant.py): values and a float32 scale per token and head, read by
the paged decode kernel and the gather path alike."""

import pytest
import torch

from kvpool.model.attention import _decode_attention
from kvpool.model.kernels import kernels
from kvpool.model.kv_quant import SCALE_BYTES, dequantize_kv, quantize_kv, row_width

kern = kernels()


def test_rows_are_values_then_scale_within_half_a_step():
    x = torch.randn(7, 3, 64, generator=torch.Generator().manual_seed(0))
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, 64 + SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.allclose(scale, x.abs().amax(-1, keepdim=True) / 127)
    assert ((dequantize_kv(rows, torch.float32) - x).abs() <= scale / 2 + 1e-7).all()
    assert torch.equal(dequantize_kv(quantize_kv(torch.zeros(2, 8)), torch.float32),
                       torch.zeros(2, 8))  # fmt: skip
    assert row_width(64, torch.int8) == 68 and row_width(64, torch.float32) == 64


@pytest.mark.skipif(kern is None, reason="no C++ compiler for the kernels")
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("d", [16, 64])  # the portable passes, the AVX-512 ones
def test_kernel_reads_int8_rows_as_the_gather_path_does(batch, d):
    g = torch.Generator().manual_seed(batch)
    bs, heads, kv_heads, blocks = 4, 6, 2, 40
    cache = quantize_kv(torch.randn(blocks, 2, bs, kv_heads, d, generator=g))
    lens = torch.randint(1, 30, (batch,), generator=g)
    width = int((lens.max() + bs - 1) // bs)
    table = torch.zeros(batch, width, dtype=torch.long)
    for b in range(batch):
        n = int((lens[b] + bs - 1) // bs)
        table[b, :n] = torch.randperm(blocks - 1, generator=g)[:n] + 1
    q = torch.randn(batch, heads, d, generator=g)
    mask = (torch.arange(width * bs)[None] < lens[:, None])[:, None, None, :]
    want = _decode_attention(q, cache, table, mask)  # gathers and dequantizes
    got = kern.paged_decode_attention(q, cache, table, lens, d**-0.5)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    with pytest.raises(RuntimeError, match="head shapes"):
        kern.paged_decode_attention(q, cache[..., :d].contiguous(), table, lens, d**-0.5)

"""The compiled paged decode-attention kernel against the gather + SDPA reference path."""

import pytest
import torch

from kvpool.model.attention import _decode_attention
from kvpool.model.kernels import paged_kernels
from kvpool.model.kv_quant import dequantize_kv, quantize_kv

kern = paged_kernels()
pytestmark = pytest.mark.skipif(kern is None, reason="no C++ compiler for the kernel")


def case(dtype, batch=5, heads=6, kv_heads=2, d=16, bs=4, layers=3, blocks=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(blocks, layers, 2, bs, kv_heads, d, generator=g).to(dtype)
    lens = torch.randint(1, 30, (batch,), generator=g)
    width = int((lens.max() + bs - 1) // bs)
    table = torch.zeros(batch, width, dtype=torch.long)
    for b in range(batch):
        n = int((lens[b] + bs - 1) // bs)
        table[b, :n] = torch.randperm(blocks - 1, generator=g)[:n] + 1
    q = torch.randn(batch, heads, d, generator=g).to(dtype)
    mask = (torch.arange(width * bs)[None] < lens[:, None])[:, None, None, :]
    return q, cache[:, 1], table, lens, mask


# batch 1: a sequence cut into chunks merged by their softmax states; 5 and 40: fewer or one
# chunk per sequence. Head size 16 runs the portable passes, 64 and 128 the AVX-512 ones
# (where the CPU has them).
@pytest.mark.parametrize("batch", [1, 5, 40])
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_reference(dtype, tol, batch, d):
    for seed in range(3):
        q, layer, table, lens, mask = case(dtype, batch=batch, d=d, seed=seed, blocks=400)
        want = _decode_attention(q, layer, table, mask).float()
        got = kern.paged_decode_attention(q, layer, table, lens, q.shape[-1] ** -0.5).float()
        assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


# The AVX-512 passes serve a KV head's query rows together, up to four at a time for the
# scores and 16 / (head size / 16) for the values: every group size, split or not.
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 4), (9, 3), (8, 2), (10, 2),
                                                 (14, 2), (9, 1)])  # fmt: skip
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("int8", [False, True])
def test_every_gqa_group_size_matches_reference(heads, kv_heads, d, int8):
    for batch in (1, 6):
        q, layer, table, lens, mask = case(torch.float32, batch=batch, heads=heads,
                                           kv_heads=kv_heads, d=d, seed=batch, blocks=200)  # fmt: skip
        if int8:  # the int8 rows, and the float rows they stand for as the reference's input
            layer = quantize_kv(layer)
            ref = dequantize_kv(layer, torch.float32)
        else:
            ref = layer
        want = _decode_attention(q, ref, table, mask)
        got = kern.paged_decode_attention(q, layer, table, lens, d**-0.5)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_kernel_rejects_bad_inputs():
    q, layer, table, lens, _ = case(torch.float32)
    bad = table.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="block id out of range"):
        kern.paged_decode_attention(q, layer, bad, lens, 0.25)
    with pytest.raises(RuntimeError, match="length out of range"):
        kern.paged_decode_attention(q, layer, table, lens * 100, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        kern.paged_decode_attention(q, layer, table.int(), lens, 0.25)


def test_engine_outputs_equal_with_and_without_kernel(tiny_engine_factory):
    from kvpool import SamplingParams

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 18, 40)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = []
    for use in (True, False):
        eng = tiny_engine_factory(use_kernels=use)
        assert (eng.runner.kernels is not None) == use
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, sp)
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                done[o.request_id] = o.outputs[0].token_ids
        outs.append([done[str(i)] for i in range(len(prompts))])
    assert outs[0] == outs[1]

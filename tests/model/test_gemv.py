"""The few-row kernel over repacked weights (kernels/gemv.cpp) against the per-row tiles and
the scalar reference, and its use by the linear layers and the fused decode step."""

import pytest
import torch

from kvpool.model.kernels import kernels
from kvpool.model.linear import BlockLinear, DenseLinear, prompt_args
from kvpool.model.quant import quantize

kern = kernels()
pytestmark = pytest.mark.skipif(kern is None, reason="no C++ compiler for the kernels")


def _avx512():
    if not kern.has_avx512():
        pytest.skip("the few-row kernel is AVX-512 only; this CPU runs the per-row tiles")


def _blocks(kind, n, k, half, seed=0):
    g = torch.Generator().manual_seed(seed)
    bw = quantize(torch.randn(n, k, generator=g) * 0.05, kind)
    if half:
        bw.d = bw.d.half()
        bw.m = bw.m.half() if bw.m.numel() else bw.m
    return bw


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("k", [64, 576, 1536])  # a tail chunk only; 16 + 2 blocks; 3 x 16
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])  # 5-11: groups of 4 and the rest
def test_packed_rows_compute_what_the_per_row_tiles_do(kind, k, half, rows):
    _avx512()
    bw = _blocks(kind, 37, k, half, seed=k + rows)  # 37 weight rows: a last tile of one
    packed = kern.gemv_pack(bw.qs, kind == "q4")
    assert packed.shape == bw.qs.shape and packed.dtype == bw.qs.dtype
    assert not torch.equal(packed, bw.qs) or k == 64  # repacked (a pair chunk is the file's)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = kern.qlinear(x, bw.qs, bw.d, bw.m, packed=packed)
    tiles = kern.qlinear(x, bw.qs, bw.d, bw.m)
    portable = kern.qlinear(x, bw.qs, bw.d, bw.m, portable=True)
    scale = portable.abs().max()
    assert (got - portable).abs().max() <= 1e-5 * scale
    assert (got - tiles).abs().max() <= 1e-5 * scale
    base = torch.randn(rows, 37)
    added = kern.qlinear(x, bw.qs, bw.d, bw.m, base.clone(), packed=packed)
    assert (added - (base + got)).abs().max() <= 1e-6 * (scale + base.abs().max())


def test_packing_a_q4_row_moves_each_nibble_where_the_layout_says():
    # one row of 16 blocks whose element e of block b holds (b + e) % 16: vector v, lane k of
    # the chunk is element 2v + k % 2 of block k // 2 (gemv.cpp's layout), two vectors a byte
    _avx512()
    q = torch.tensor([[(b + e) % 16 for e in range(32)] for b in range(16)], dtype=torch.uint8)
    qs = (q[:, :16] | (q[:, 16:] << 4)).reshape(1, 256)
    packed = kern.gemv_pack(qs, True).reshape(8, 32)
    for v in range(16):
        for k in range(32):
            nibble = packed[v // 2, k] >> 4 if v % 2 else packed[v // 2, k] & 0x0F
            assert int(nibble) == (k // 2 + 2 * v + k % 2) % 16


def test_what_the_kernel_cannot_run_is_not_packed_and_takes_the_tiles():
    bw = quantize(torch.randn(8, 96), "q4")  # 3 blocks a row: no pair chunks
    assert kern.gemv_pack(bw.qs, True).numel() == 0
    x = torch.randn(1, 96)
    assert torch.equal(kern.qlinear(x, bw.qs, bw.d, bw.m, packed=torch.empty(0, dtype=torch.uint8)),
                       kern.qlinear(x, bw.qs, bw.d, bw.m))  # fmt: skip
    if kern.has_avx512():
        ok = quantize(torch.randn(8, 64), "q4")
        with pytest.raises(RuntimeError, match="packed must be"):
            kern.qlinear(torch.randn(1, 64), ok.qs, ok.d, ok.m, packed=ok.qs[:4].contiguous())


@pytest.mark.parametrize("rows", [5, 7, 11])
def test_more_rows_than_a_group_compute_each_row_as_its_own_group_does(rows):
    # beyond GEMV_GROUP rows each weight row runs the row groups one after the other: every
    # row's result is bit for bit what a call with its group alone gives
    _avx512()
    assert kern.GEMV_ROWS == 11 and rows <= kern.GEMV_ROWS
    for kind, half in (("q4", True), ("q8", False)):
        bw = _blocks(kind, 37, 576, half, seed=rows)
        packed = kern.gemv_pack(bw.qs, kind == "q4")
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        got = kern.qlinear(x, bw.qs, bw.d, bw.m, packed=packed)
        for m0 in range(0, rows, 4):
            part = x[m0 : m0 + 4].contiguous()
            assert torch.equal(
                got[m0 : m0 + 4], kern.qlinear(part, bw.qs, bw.d, bw.m, packed=packed)
            )


def test_many_rows_and_prompt_steps_never_take_the_packed_path():
    # from LANES_FROM rows on the lanes path runs, and a prompt step takes it for any size:
    # results identical to calls without the packed copy (a prompt's KV must not depend on
    # how its chunks were cut)
    _avx512()
    bw = _blocks("q4", 40, 576, True)
    packed = kern.gemv_pack(bw.qs, True)
    x = torch.randn(12, 576)
    assert torch.equal(kern.qlinear(x, bw.qs, bw.d, bw.m, packed=packed),
                       kern.qlinear(x, bw.qs, bw.d, bw.m))  # fmt: skip
    one = x[:1]
    assert torch.equal(kern.qlinear(one, bw.qs, bw.d, bw.m, lanes_from=1, packed=packed),
                       kern.qlinear(one, bw.qs, bw.d, bw.m, lanes_from=1))  # fmt: skip
    lin = BlockLinear(
        bw, kern, large=DenseLinear(bw.dequantize()), small_rows=64, prompt_blocks=True
    )
    assert lin.packed is not None and lin.spec()["packed"] is lin.packed
    assert torch.equal(lin(one, prompt=True), kern.qlinear(one, bw.qs, bw.d, bw.m, **prompt_args()))
    assert torch.equal(lin(one), kern.qlinear(one, bw.qs, bw.d, bw.m, packed=packed))

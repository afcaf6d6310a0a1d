"""Block-quantized weights (model/quant.py) and the qlinear kernel against float references."""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvpool.model.kernels import kernels
from kvpool.model.quant import BlockWeights, cat_rows, from_gguf_blocks, quantize

kern = kernels()
needs_kernel = pytest.mark.skipif(kern is None, reason="no C++ compiler for the kernels")


def weights(n=40, k=96, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_quantize_error_is_within_half_a_step(kind):
    w = weights()
    bw = quantize(w, kind)
    err = (bw.dequantize() - w).abs().reshape(40, 3, 32)
    assert (err <= bw.d[..., None] / 2 + 1e-6).all()
    assert bw.shape == (40, 96)
    assert bw.nbytes == {"q4": 40 * 48 + 2 * 40 * 3 * 4, "q8": 40 * 96 + 40 * 3 * 4}[kind]


def test_quantize_refuses_what_does_not_cut_into_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 40), "q8")
    with pytest.raises(ValueError, match="kind"):
        quantize(torch.zeros(4, 32), "q2")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_are_taken_exactly(qtype):
    x = weights(16, 128).numpy()
    raw = gguf.quants.quantize(x, qtype)
    bw = from_gguf_blocks(raw, qtype)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(bw.dequantize(), want)
    assert bw.kind == ("q8" if qtype == Q.Q8_0 else "q4")
    assert bw.d.dtype == torch.float16  # as the file holds them: exact, fewer bytes
    if qtype != Q.Q4_0:  # Q4_0 has no offsets in the file: m = -8 d is added
        assert bw.nbytes == raw.nbytes


def test_rows_reorder_and_stack():
    a, b = quantize(weights(8, 64, 1), "q4"), quantize(weights(4, 64, 2), "q4")
    both = cat_rows([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    idx = torch.tensor([3, 0, 2, 1, 7, 6, 5, 4])
    assert torch.equal(a.rows(idx).dequantize(), a.dequantize()[idx])
    with pytest.raises(ValueError, match="kinds"):
        cat_rows([a, quantize(weights(4, 64), "q8")])


@needs_kernel
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 33])
@pytest.mark.parametrize("k", [160, 576])  # 5 blocks; 18 (two groups of 8 and a tail of 2)
def test_qlinear_matches_float_arithmetic_on_the_same_weights(kind, rows, k):
    # 16-bit activations: the result is float32's on the dequantized weights, to ~1e-5
    bw = quantize(weights(37, k), kind)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = x @ bw.dequantize().t()
    got = kern.qlinear(x, bw.qs, bw.d, bw.m)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-4 * scale
    portable = kern.qlinear(x, bw.qs, bw.d, bw.m, portable=True)  # the scalar path
    assert (portable - got).abs().max() <= 1e-5 * scale
    narrow = kern.qlinear(x, bw.qs, bw.d, bw.m, wide=False)  # AVX2 where AVX-512 is built in
    assert (narrow - got).abs().max() <= 1e-5 * scale


@needs_kernel
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("k", [32, 96, 1536])  # one block (odd); 3 blocks (odd tail); 48
def test_qlinear_wide_and_narrow_paths_agree(kind, k):
    # the AVX-512 path pairs q4 blocks: an odd count ends with a half-filled vector
    if not kern.has_avx2():
        pytest.skip("no AVX2 path on this machine: only the scalar path exists")
    bw = quantize(weights(70, k, 3), kind)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(k))
    want = x @ bw.dequantize().t()
    wide = kern.qlinear(x, bw.qs, bw.d, bw.m)
    narrow = kern.qlinear(x, bw.qs, bw.d, bw.m, wide=False)
    scale = want.abs().max()
    assert (wide - want).abs().max() <= 1e-4 * scale
    assert (wide - narrow).abs().max() <= 1e-5 * scale


@needs_kernel
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("rows", [12, 16, 17, 33, 64])  # one group, a partial one, odd counts
@pytest.mark.parametrize("half", [False, True])
def test_qlinear_lanes_path_agrees_with_the_per_row_path(kind, rows, half):
    # from 12 rows on, AVX-512 machines put 16 activation rows in a vector's lanes; 37 weight
    # rows end with a tile of one; accumulating into `out` and float16 scales go through it too
    if not kern.has_avx512():
        pytest.skip("the lanes path is AVX-512 only; this CPU runs the per-row paths")
    bw = quantize(weights(37, 160, rows), kind)
    d, m = (bw.d.half(), bw.m.half() if bw.m.numel() else bw.m) if half else (bw.d, bw.m)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    lanes = kern.qlinear(x, bw.qs, d, m, lanes_from=1)
    per_row = kern.qlinear(x, bw.qs, d, m, lanes_from=0)
    portable = kern.qlinear(x, bw.qs, d, m, portable=True)
    scale = portable.abs().max()
    assert (lanes - portable).abs().max() <= 1e-5 * scale
    assert (lanes - per_row).abs().max() <= 1e-5 * scale
    assert torch.equal(kern.qlinear(x, bw.qs, d, m), lanes if rows >= 12 else per_row)
    base = torch.randn(rows, 37)
    added = kern.qlinear(x, bw.qs, d, m, base.clone(), lanes_from=1)
    assert (added - (base + lanes)).abs().max() <= 1e-6 * (scale + base.abs().max())


def act8_reference(x: torch.Tensor) -> torch.Tensor:
    """x as the 8-bit activation path sees it: each 32-element block on [-127, 127] steps of
    its absolute maximum / 127, rounded half to even."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 12, 17, 64])
@pytest.mark.parametrize("half", [False, True])
def test_qlinear_lanes_path_with_8_bit_activations(rows, half):
    # prompt steps over q4 weights (linear.prompt_args): x is quantized to int8 per block, the
    # products run four at a time (vpdpbusd); the result is float32's on the dequantized weights
    # and the 8-bit x, to rounding, and a row's bits do not depend on the batch around it
    if not kern.has_avx512():
        pytest.skip("the lanes path is AVX-512 only; this CPU runs the per-row paths")
    bw = quantize(weights(37, 576, rows), "q4")
    d, m = (bw.d.half(), bw.m.half()) if half else (bw.d, bw.m)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    x[:, 64:96] = 0.0  # an all-zero block: scale 0, no division by it
    got = kern.qlinear(x, bw.qs, d, m, lanes_from=1, act8=True)
    w = BlockWeights("q4", bw.qs, d.float(), m.float()).dequantize()  # the scales' own values
    want = act8_reference(x) @ w.t()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale
    sixteen = kern.qlinear(x, bw.qs, d, m, lanes_from=1)
    assert not torch.equal(got, sixteen)  # 8 bits are not 16: the switch does switch
    assert (got - sixteen).abs().max() <= 3e-2 * scale
    if rows > 1:
        assert torch.equal(kern.qlinear(x[1:], bw.qs, d, m, lanes_from=1, act8=True), got[1:])
    base = torch.randn(rows, 37)
    added = kern.qlinear(x, bw.qs, d, m, base.clone(), lanes_from=1, act8=True)
    assert (added - (base + got)).abs().max() <= 1e-6 * (scale + base.abs().max())


@needs_kernel
def test_8_bit_activations_apply_to_q4_weights_only():
    # q8 weights (signed bytes) keep 16-bit activations: act8 changes nothing for them
    bw = quantize(weights(37, 160, 1), "q8")
    x = torch.randn(20, 160, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kern.qlinear(x, bw.qs, bw.d, bw.m, lanes_from=1, act8=True),
                       kern.qlinear(x, bw.qs, bw.d, bw.m, lanes_from=1))  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("rows", [5, 40])
def test_qlinear_lanes_path_reads_rows_of_a_wider_tensor(rows):
    # the lanes path quantizes x straight from its rows (lanes.cpp): a view whose rows sit
    # further apart than K gives the same bits as its contiguous copy
    bw = quantize(weights(20, 96, rows), "q4")
    wide = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    x = wide[:, 32:128]
    assert x.stride(0) == 160
    got = kern.qlinear(x, bw.qs, bw.d, bw.m, lanes_from=1)
    assert torch.equal(got, kern.qlinear(x.contiguous(), bw.qs, bw.d, bw.m, lanes_from=1))
    want = x @ bw.dequantize().t()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@needs_kernel
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_qlinear_lanes_path_gives_a_row_the_same_bits_in_any_batch(kind):
    # prompt steps run it for any number of rows, so a prompt's results do not depend on the
    # sizes of the chunks it was cut into; 1,000 rows of K=1,536 take several of the slices a
    # many-row call is cut into (LANES_SLICE), and chunks start off a group's boundary
    if not kern.has_avx512():
        pytest.skip("the lanes path is AVX-512 only; this CPU runs the per-row paths")
    bw = quantize(weights(37, 1536, 3), kind)
    x = torch.randn(1000, 1536, generator=torch.Generator().manual_seed(3))
    full = kern.qlinear(x, bw.qs, bw.d, bw.m, lanes_from=1)
    for a, b in [(0, 1), (1, 8), (8, 30), (30, 517), (517, 1000)]:
        assert torch.equal(kern.qlinear(x[a:b], bw.qs, bw.d, bw.m, lanes_from=1), full[a:b])
    portable = kern.qlinear(x, bw.qs, bw.d, bw.m, portable=True)
    assert (full - portable).abs().max() <= 1e-5 * portable.abs().max()


@needs_kernel
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("wide", [True, False])
def test_qlinear_float16_scales_compute_what_their_float32_values_do(kind, wide):
    # a GGUF's scales stay float16 (fewer bytes per step): the same values as float32 give
    # the same arithmetic, so the same results to float rounding (the compiler may contract
    # the two paths' multiplies differently), on every path
    bw = quantize(weights(45, 160, 4), kind)
    d16 = bw.d.half()
    m16 = bw.m.half() if kind == "q4" else bw.m
    d32, m32 = d16.float(), (m16.float() if kind == "q4" else bw.m)
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(5))
    got = kern.qlinear(x, bw.qs, d16, m16, wide=wide)
    scale = got.abs().max()
    assert (got - kern.qlinear(x, bw.qs, d32, m32, wide=wide)).abs().max() <= 1e-6 * scale
    scalar16 = kern.qlinear(x, bw.qs, d16, m16, portable=True)
    scalar32 = kern.qlinear(x, bw.qs, d32, m32, portable=True)
    assert (scalar16 - scalar32).abs().max() <= 1e-6 * scale
    assert (scalar16 - got).abs().max() <= 1e-5 * scale
    want = x @ BlockWeights(bw.kind, bw.qs, d32, m32).dequantize().t()
    assert (got - want).abs().max() <= 1e-4 * scale
    if kind == "q4":
        with pytest.raises(RuntimeError, match="m must be"):
            kern.qlinear(x, bw.qs, d16, m32)  # mixed scale types


@needs_kernel
def test_the_wide_path_is_built_where_the_cpu_has_avx512():
    # the kernels compile with -march=native: an AVX-512 CPU must get the AVX-512 path
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    assert kern.has_avx512() == ({"avx512f", "avx512bw"} <= flags)
    assert kern.has_avx2() == ({"avx2", "fma"} <= flags)


@needs_kernel
def test_qlinear_adds_into_out_and_reads_strided_rows():
    bw = quantize(weights(24, 64), "q4")
    wide = torch.randn(3, 100)
    x = wide[:, 4:68]  # rows with a stride of 100
    base = torch.randn(3, 24)
    out = base.clone()
    res = kern.qlinear(x, bw.qs, bw.d, bw.m, out)
    assert res.data_ptr() == out.data_ptr()
    want = base + x @ bw.dequantize().t()
    assert torch.allclose(out, want, atol=1e-4)


@needs_kernel
def test_qlinear_rejects_bad_inputs():
    bw = quantize(weights(8, 64), "q4")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kern.qlinear(torch.zeros(1, 40), bw.qs, bw.d, bw.m)
    with pytest.raises(RuntimeError, match="wrong width"):
        kern.qlinear(torch.zeros(1, 96), bw.qs, bw.d, bw.m)
    with pytest.raises(RuntimeError, match="float32"):
        kern.qlinear(torch.zeros(1, 64, dtype=torch.float64), bw.qs, bw.d, bw.m)
    with pytest.raises(RuntimeError, match="m must be"):
        kern.qlinear(torch.zeros(1, 64), bw.qs, bw.d, torch.zeros(3))
    with pytest.raises(RuntimeError, match="out must be"):
        kern.qlinear(torch.zeros(2, 64), bw.qs, bw.d, bw.m, torch.zeros(1, 8))
    assert isinstance(bw, BlockWeights)


@pytest.mark.parametrize(("value", "want"), [(None, False), ("0", False), ("1", True)])
def test_prompt_act8_is_off_unless_the_environment_asks(value, want):
    # KVPOOL_PROMPT_ACT8 reaches every worker of `kvpool serve` through its environment
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_PROMPT_ACT8"}
    if value is not None:
        env["KVPOOL_PROMPT_ACT8"] = value
    out = subprocess.run([sys.executable, "-c", "from kvpool.model.linear import prompt_args; "
                          "print(prompt_args()['act8'])"], env=env, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip() == str(want)

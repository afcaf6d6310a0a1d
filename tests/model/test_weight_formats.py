"""Weight formats (model/weight_formats.py): which layers each builds, ``auto``'s choice, the
fused decode step against the per-op Python path, and the cached batch-size limit."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvpool.common.errors import ModelLoadError
from kvpool.model import autotune
from kvpool.model.attention import AttentionMetadata, PrefillSeq
from kvpool.model.kernels import kernels
from kvpool.model.kv_layout import kv_shape
from kvpool.model.kv_quant import dequantize_kv
from kvpool.model.linear import BlockLinear, DenseLinear, prompts_on_tiles
from kvpool.model.llama import LlamaModel
from kvpool.model.quality import block_path

kern = kernels()
needs_kernel = pytest.mark.skipif(kern is None, reason="no C++ compiler for the kernels")
BS = 4


@pytest.fixture
def tiny(tiny_model):
    return tiny_model


def build(tiny, fmt):
    return LlamaModel(tiny.config, tiny.weights, torch.float32, fmt)


def prefill(model, kv, ids, first_block):
    n = len(ids)
    table = torch.arange(first_block, first_block + -(-(n + 1) // BS))
    pos = torch.arange(n)
    meta = AttentionMetadata(table[pos // BS], pos % BS, 0, None, None, None,
                             [PrefillSeq(0, n, 0, table, None)], kern)  # fmt: skip
    model.forward(torch.tensor(ids), pos, meta, kv)
    return table


def decode_step(model, kv, tables, lens, tokens):
    """One decode token per sequence at position lens[i]; the final hidden states."""
    pos = torch.tensor(lens)
    width = max(len(t) for t in tables)
    table = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    slot_blocks = torch.stack([t[p // BS] for t, p in zip(tables, lens, strict=True)])
    meta = AttentionMetadata(slot_blocks, pos % BS, len(lens), table, pos + 1, None, [], kern)
    return model.forward(torch.tensor(tokens), pos, meta, kv)


@needs_kernel
@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("rows", ["1", "64"])  # the block kernel for 1 row / for every batch
@pytest.mark.parametrize("fmt", ["q4", "int8", "float32"])
def test_fused_decode_step_equals_the_python_path(tiny, fmt, rows, kv, monkeypatch):
    monkeypatch.setenv("KVPOOL_SMALL_ROWS", rows)
    # the prompts on BLAS whatever this machine measured for the tiny shapes: on the block
    # kernel their KV moves the decode step's inputs so that the two paths' float order can
    # flip a 16-bit rounding beyond the bound below (failed in CI whenever it was measured so)
    monkeypatch.setenv("KVPOOL_PROMPT_BLOCKS", "0")
    model = LlamaModel(tiny.config, tiny.weights, torch.float32, fmt, kv)
    assert model.fused is not None
    prompts = [[5, 9, 11, 3, 7], list(range(20, 29)), list(range(40, 57))]
    outs = []
    for fused in (model.fused, None):
        model.fused = fused
        cache = torch.zeros(kv_shape(tiny.config, 40, BS, model.kv_dtype), dtype=model.kv_dtype)
        tables = [prefill(model, cache, p, 1 + 10 * i) for i, p in enumerate(prompts)]
        h = decode_step(model, cache, tables, [len(p) for p in prompts], [1, 2, 3])
        outs.append((h, cache.clone()))
    (h1, kv1), (h2, kv2) = outs
    # the same kernels on both paths; float sums in another order (16-bit activations round
    # the difference up to ~1e-5 of a block's largest value)
    assert (h1 - h2).abs().max() <= 1e-4 * h2.abs().max()
    if kv == "int8":  # values one rounding step apart at most
        a, b = dequantize_kv(kv1, torch.float32), dequantize_kv(kv2, torch.float32)
        step = kv2[..., -4:].contiguous().view(torch.float32)
        assert ((a - b).abs() <= 1.01 * step + 1e-6).all()
    else:
        assert (kv1 - kv2).abs().max() <= 1e-4 * kv2.abs().max()  # new keys/values: same slots


@needs_kernel
def test_quantized_formats_build_block_layers_with_a_dense_fallback(tiny):
    q4 = build(tiny, "q4")
    layer = q4.layers[0]
    assert isinstance(layer.qkv, BlockLinear) and layer.qkv.weights.kind == "q4"
    assert isinstance(layer.qkv.large, DenseLinear)
    assert q4.lm_head.weights.kind == "q8"  # the head stays at 8 bits
    assert build(tiny, "int8").layers[0].down.weights.kind == "q8"
    assert isinstance(build(tiny, "float32").layers[0].o, DenseLinear)
    # a quarter of float32's weight bytes (q4 layers, q8 head)
    dense = sum(lin.nbytes for lin in (layer.qkv.large, layer.o.large))
    assert sum(lin.nbytes for lin in (layer.qkv, layer.o)) < dense / 4


@needs_kernel
def test_quantized_logits_are_close_to_float32(tiny, monkeypatch):
    monkeypatch.setenv("KVPOOL_PROMPT_BLOCKS", "0")
    ids = list(range(3, 40))
    ref, q4 = build(tiny, "float32"), build(tiny, "q4")
    from kvpool.model.quality import next_token_logprobs

    with block_path(q4):
        lp = next_token_logprobs(q4, ids)
    want = next_token_logprobs(ref, ids)
    # the tiny model's random float weights, quantized to 4 bits here: close, not equal
    assert (lp.exp() - want.exp()).abs().max() < 0.05
    assert not torch.equal(lp, want)  # block_path did run the 4-bit weights
    # outside block_path a prompt pass runs the float32 weights where prompt_blocks is off:
    # the float32 model's result
    assert torch.allclose(next_token_logprobs(q4, ids), want, atol=1e-4)
    # where it is on, prompt passes run the blocks: block_path's result, to rounding
    monkeypatch.setenv("KVPOOL_PROMPT_BLOCKS", "1")
    q4_prompt = build(tiny, "q4")
    assert q4_prompt.layers[0].qkv.prompt_blocks and not q4.layers[0].qkv.prompt_blocks
    assert torch.allclose(next_token_logprobs(q4_prompt, ids), lp, atol=1e-5)
    assert not torch.allclose(next_token_logprobs(q4_prompt, ids), want, atol=1e-4)


@needs_kernel
def test_auto_resolves_by_dtype_shapes_and_source(tiny, tmp_path, monkeypatch):
    from kvpool.model.weight_formats import resolve

    monkeypatch.setenv("KVPOOL_SMALL_ROWS", "4")
    cfg = tiny.config
    assert resolve("auto", cfg, torch.float32, None) == "int8"  # float weights: 8-bit blocks
    assert resolve("auto", cfg, torch.bfloat16, None) == "float32"
    assert resolve("q4", cfg, torch.float32, None) == "q4"
    odd = dataclasses.replace(cfg, hidden_size=48)
    assert resolve("auto", odd, torch.float32, None) == "float32"  # no 32-blocks
    monkeypatch.setenv("KVPOOL_SMALL_ROWS", "0")  # the block kernel never faster
    assert resolve("auto", cfg, torch.float32, None) == "float32"


def test_quantized_formats_refuse_what_they_cannot_run(tiny):
    with pytest.raises(ModelLoadError, match="float32"):
        LlamaModel(tiny.config, tiny.weights, torch.bfloat16, "q4")
    with pytest.raises(ValueError, match="weight format"):
        LlamaModel(tiny.config, tiny.weights, torch.float32, "q3")


@needs_kernel
def test_small_rows_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVPOOL_SMALL_ROWS", raising=False)
    calls = []
    monkeypatch.setattr(autotune, "measure_small_rows",
                        lambda *a: calls.append(a) or 8)  # fmt: skip
    assert autotune.small_rows(kern, "q4", 64, 128) == 8
    assert autotune.small_rows(kern, "q4", 64, 128) == 8
    assert len(calls) == 1
    saved = json.loads((tmp_path / "autotune" / "small_rows.json").read_text())
    assert list(saved.values()) == [8]
    monkeypatch.setenv("KVPOOL_SMALL_ROWS", "3")
    assert autotune.small_rows(kern, "q4", 64, 128) == 3


@needs_kernel
def test_measure_small_rows_returns_a_tried_batch_size():
    assert autotune.measure_small_rows(kern, "q8", 64, 96) in (0, *autotune.ROWS)


@needs_kernel
def test_prompt_blocks_is_measured_once_cached_and_overridden(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVPOOL_PROMPT_BLOCKS", raising=False)
    assert isinstance(autotune.measure_prompt_blocks(kern, "q4", 64, 96), bool)
    calls = []
    monkeypatch.setattr(autotune, "measure_prompt_blocks",
                        lambda *a: calls.append(a) or True)  # fmt: skip
    assert autotune.prompt_blocks(kern, "q4", 64, 128) is True
    assert autotune.prompt_blocks(kern, "q4", 64, 128) is True
    assert len(calls) == 1
    saved = json.loads((tmp_path / "autotune" / "prompt_blocks.json").read_text())
    assert list(saved.values()) == [True]
    # the key names the kernels' build (their sources' digest): a changed kernel measures again
    assert Path(kern.__file__).parent.name in next(iter(saved))
    monkeypatch.setenv("KVPOOL_PROMPT_BLOCKS", "0")
    assert autotune.prompt_blocks(kern, "q4", 64, 128) is False


def test_cached_measurements_are_keyed_by_the_cpu_not_just_its_name():
    zen1 = "processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 23\nmodel\t: 1\nstepping\t: 2\n" \
        "flags\t\t: fpu sse avx2 fma\n\nprocessor\t: 1\nmodel name\t: other\n"  # fmt: skip
    zen4 = zen1.replace("23", "25").replace("avx2 fma", "avx2 fma avx512f avx512bw")
    assert autotune.cpu_id(zen1) != autotune.cpu_id(zen4)
    assert autotune.cpu_id(zen1) == autotune.cpu_id(zen1)
    assert autotune.cpu_id(zen1).startswith("AMD EPYC|f23-m1-s2|")
    same_but_flags = zen1.replace("avx2 fma", "avx2")
    assert autotune.cpu_id(same_but_flags) != autotune.cpu_id(zen1)


def test_prompts_on_tiles_looks_through_to_the_dense_layer():
    """Which layers take prompt steps on AMX tiles: a dense one with packed tiles, or a block
    layer whose big batches go to one (the model attends on tiles only then)."""
    from types import SimpleNamespace

    dense = DenseLinear(torch.zeros(32, 32))
    assert not prompts_on_tiles(dense)
    assert not prompts_on_tiles(SimpleNamespace(large=dense))
    assert not prompts_on_tiles(SimpleNamespace(large=None)) and not prompts_on_tiles(object())
    dense.amx = torch.zeros(1)  # as ``with_amx`` leaves it (the packing needs AMX)
    assert prompts_on_tiles(dense) and prompts_on_tiles(SimpleNamespace(large=dense))

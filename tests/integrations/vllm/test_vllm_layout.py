"""The layout conversion between vLLM's paged KV tensors and kvpool's KV objects (no vLLM
needed: ``layout.py`` is pure torch; the map vLLM's kernel really uses is measured by
``probe_block_map`` and exercised in ``test_vllm_connector.py``)."""

from __future__ import annotations

import pytest
import torch

from kvpool.integrations.vllm.layout import BlockMap, VllmLayout, gather, head_major_map, scatter

LAYOUT = VllmLayout(num_layers=3, kv_heads=2, head_dim=4, vllm_block=32, kv_block=16)


@pytest.mark.parametrize("transposed", [True, False])
def test_gather_follows_the_map_and_scatter_inverts_it(transposed):
    bmap = head_major_map(LAYOUT, transposed)
    bmap.check(LAYOUT)
    layers = [torch.randn(10, 2, 32, 8) for _ in range(3)]
    vblocks, subs, rows = [3, 3, 7, 1], [0, 1, 1, 0], [5, 0, 2, 3]
    out = torch.full((6, *LAYOUT.block_shape()), float("nan"))
    gather(LAYOUT, bmap, layers, vblocks, subs, out, rows)
    # layer 1, vLLM block 7, second kvpool block, token 5 (21 of the vLLM block), head 1, dim 2
    head = layers[1][7].reshape(2, -1)[1]  # one head's 32 x 8 elements: keys, then values
    key_at = 2 * 32 + 21 if transposed else 21 * 4 + 2
    assert out[2, 1, 0, 5, 1, 2] == head[key_at]
    assert out[2, 1, 1, 5, 1, 2] == head[32 * 4 + 21 * 4 + 2]
    assert not out[[1, 4]].isfinite().any()  # rows not named are untouched

    fresh = [torch.zeros_like(t) for t in layers]
    scatter(LAYOUT, bmap, out, rows, fresh, vblocks, subs)
    back = torch.empty(4, *LAYOUT.block_shape())
    gather(LAYOUT, bmap, fresh, vblocks, subs, back, [0, 1, 2, 3])
    assert torch.equal(back, out[rows])
    assert all(torch.equal(a[3], b[3]) for a, b in zip(layers, fresh, strict=True))
    assert all(not b[[0, 2, 4, 5, 6, 8, 9]].any() for b in fresh)  # other blocks untouched


@pytest.mark.parametrize("form", ["transposed", "plain", "other"])
@pytest.mark.parametrize("case", [
    ([5, 5, 2, 2, 9], [0, 1, 0, 1, 1], [4, 1, 0, 3, 2]),  # whole blocks, out of order
    ([2, 2, 3, 3], [0, 1, 0, 1], [0, 1, 2, 3]),  # consecutive blocks and rows: plain slices
    ([6, 6, 6, 7], [1, 0, 1, 0], [3, 2, 0, 1]),  # a sub-block twice (the last one wins)
])  # fmt: skip
def test_whole_block_copies_equal_the_element_map(form, case):
    """Whole vLLM blocks take strided copies (head-major maps); the result is the one the
    element-by-element map gives, and any other map (here a random permutation) still works."""
    vblocks, subs, rows = case
    g = torch.Generator().manual_seed(3)
    if form == "other":
        perm = torch.randperm(LAYOUT.block_elems, generator=g)
        half = LAYOUT.block_elems // 2
        bmap = BlockMap(perm[:half].view(32, 2, 4).clone(), perm[half:].view(32, 2, 4).clone())
    else:
        bmap = head_major_map(LAYOUT, form == "transposed")
    assert bmap.head_major == {"transposed": True, "plain": False, "other": None}[form]
    layers = [torch.randn(10, 2, 32, 8, generator=g) for _ in range(3)]
    out = torch.zeros((6, *LAYOUT.block_shape()))
    gather(LAYOUT, bmap, layers, vblocks, subs, out, rows)
    lin = torch.stack([bmap.keys.view(2, 16, 2, 4), bmap.values.view(2, 16, 2, 4)], dim=1)
    for v, sb, r in zip(vblocks, subs, rows, strict=True):
        for i, t in enumerate(layers):  # the map, element by element
            assert torch.equal(out[r, i], t[v].reshape(-1)[lin[sb]])
    fresh = [torch.zeros_like(t) for t in layers]
    scatter(LAYOUT, bmap, out, rows, fresh, vblocks, subs)
    for v, sb, r in zip(vblocks, subs, rows, strict=True):
        for i, t in enumerate(fresh):
            assert torch.equal(t[v].reshape(-1)[lin[sb]], out[r, i])
    touched = set(vblocks)
    assert all(not t[[b for b in range(10) if b not in touched]].any() for t in fresh)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="cannot be cut"):
        VllmLayout(3, 2, 4, vllm_block=32, kv_block=24)
    bmap = head_major_map(LAYOUT, True)
    broken = BlockMap(bmap.keys.clone(), bmap.keys.clone())  # values alias the keys
    with pytest.raises(ValueError, match="not a permutation"):
        broken.check(LAYOUT)
    with pytest.raises(ValueError, match="layout this connector does not know"):
        LAYOUT.check_layer("model.layers.0.self_attn.attn", torch.zeros(10, 2, 16, 8))


def _vllm_config(folder, dtype=torch.float32, block=32, layers=30):
    from types import SimpleNamespace as NS

    hf = NS(num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_size=576,
            num_hidden_layers=layers)  # fmt: skip
    return NS(model_config=NS(model=str(folder), hf_config=hf, dtype=dtype),
              cache_config=NS(block_size=block))  # fmt: skip


def test_vllm_namespace_is_kvpools_and_differs_where_objects_cannot_be_shared(tmp_path):
    import json

    from kvpool.common.hashing import kv_namespace
    from kvpool.integrations.vllm.layout import pool_namespace
    from kvpool.model.loader import folder_fingerprint

    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "kvpool.json").write_text(json.dumps({"fingerprint": "smollm2-135m-abc"}))
    ns, layout = pool_namespace(_vllm_config(folder), 16)
    # the string kvpool's engine builds for the same weights, dtype and block size
    assert ns == kv_namespace("smollm2-135m-abc", dtype="float32", block_size=16, num_layers=30,
                              num_kv_heads=3, head_dim=64)  # fmt: skip
    assert layout == VllmLayout(30, 3, 64, 32, 16)
    other = tmp_path / "plain"  # no kvpool.json: a digest of config.json and the weights
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors").write_bytes(b"weights")
    assert folder_fingerprint(other) in pool_namespace(_vllm_config(other), 16)[0]
    variants = {
        pool_namespace(_vllm_config(folder, dtype=torch.bfloat16), 16)[0],
        pool_namespace(_vllm_config(folder), 32)[0],
        pool_namespace(_vllm_config(folder, layers=12), 16)[0],
        pool_namespace(_vllm_config(other), 16)[0],
    }
    assert ns not in variants and len(variants) == 4
    # a bfloat16 vLLM asked to keep float32 objects shares the float32 engines' namespace
    bf16 = _vllm_config(folder, dtype=torch.bfloat16)
    assert pool_namespace(bf16, 16, "float32")[0] == ns
    with pytest.raises(ValueError, match="pool dtype"):
        pool_namespace(bf16, 16, "int8")


@pytest.mark.parametrize("transposed", [True, False, None])
def test_conversion_between_vllm_bfloat16_and_float32_objects(transposed):
    """Saves widen bfloat16 exactly; loads of float32 objects round to bfloat16 (the only loss,
    named here: at most half a bfloat16 unit in the last place, relative 2**-8)."""
    if transposed is None:
        perm = torch.randperm(LAYOUT.block_elems, generator=torch.Generator().manual_seed(1))
        half = LAYOUT.block_elems // 2
        bmap = BlockMap(perm[:half].view(32, 2, 4).clone(), perm[half:].view(32, 2, 4).clone())
    else:
        bmap = head_major_map(LAYOUT, transposed)
    layers = [torch.randn(6, 2, 32, 8).to(torch.bfloat16) for _ in range(3)]
    vblocks, subs, rows = [4, 4, 1], [0, 1, 1], [0, 1, 2]
    out = torch.empty((3, *LAYOUT.block_shape()), dtype=torch.float32)
    gather(LAYOUT, bmap, layers, vblocks, subs, out, rows)
    fresh = [torch.zeros_like(t) for t in layers]
    scatter(LAYOUT, bmap, out, rows, fresh, vblocks, subs)
    assert all(torch.equal(a[4], b[4]) for a, b in zip(layers, fresh, strict=True))  # exact
    wide = torch.randn(3, *LAYOUT.block_shape())  # float32 objects from a float32 engine
    scatter(LAYOUT, bmap, wide, rows, fresh, vblocks, subs)
    back = torch.empty_like(wide)
    gather(LAYOUT, bmap, fresh, vblocks, subs, back, rows)
    assert torch.equal(back, wide.to(torch.bfloat16).to(torch.float32))  # round to nearest
    assert ((back - wide).abs() <= wide.abs() * 2**-8).all()

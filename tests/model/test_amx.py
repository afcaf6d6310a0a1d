"""Prompt steps on AMX tiles (kernels/amx.cpp): each operand split in two bfloat16 halves, so
the results are float32's to ~1e-5, and every row summed in one order whatever the step's
size. Skipped, with the reason, on CPUs (or builds) without AMX-BF16."""

import pytest
import torch

from kvpool.model import autotune
from kvpool.model.kernels import kernels
from kvpool.model.linear import BlockLinear, DenseLinear
from kvpool.model.llama import LlamaModel
from kvpool.model.quality import next_token_logprobs

kern = kernels()
pytestmark = pytest.mark.skipif(
    kern is None or not kern.has_amx(),
    reason="no AMX-BF16 here (CPU or build): the prompt path on tiles is not used",
)
SHAPES = [(48, 64), (576, 576), (960, 576), (576, 1536)]  # [N, K]


def case(n, k, m=75, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    return w, x


@pytest.mark.parametrize("n,k", SHAPES)
def test_results_are_float32_to_rounding(n, k):
    w, x = case(n, k)
    want = x.double() @ w.double().t()
    got = kern.amx_linear(x, kern.amx_pack(w))
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err < 2e-5 * scale
    # one bfloat16 product alone would be ~100x further off: the halves are used
    plain = x.bfloat16().float().double() @ w.bfloat16().float().double().t()
    assert err < (plain - want).abs().max().item() / 20


@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_has_the_same_bits_in_any_step(n, k):
    w, x = case(n, k, m=100)
    tiles = kern.amx_pack(w)
    whole = kern.amx_linear(x, tiles)
    for start, rows in ((0, 1), (3, 5), (10, 16), (17, 33), (40, 60)):
        part = kern.amx_linear(x[start : start + rows], tiles)
        assert torch.equal(part, whole[start : start + rows]), (start, rows)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kern.amx_linear(x, tiles), whole)
    finally:
        torch.set_num_threads(threads)


def test_bias_and_accumulation():
    w, x = case(576, 576)
    tiles = kern.amx_pack(w)
    y = kern.amx_linear(x, tiles)
    b = torch.randn(576)
    assert torch.equal(kern.amx_linear(x, tiles, bias=b), y + b)
    h = torch.randn(x.shape[0], 576)
    out = h.clone()
    assert kern.amx_linear(x, tiles, out) is not None
    assert torch.equal(out, h + y)  # added in place, in that order
    strided = torch.randn(x.shape[0], 1152)[:, :576]  # rows with a stride, contiguous within
    strided.copy_(x)
    assert torch.equal(kern.amx_linear(strided, tiles), y)


def test_bad_input_is_refused_with_a_message():
    w, x = case(64, 64)
    tiles = kern.amx_pack(w)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kern.amx_pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="float32"):
        kern.amx_pack(w.double())
    with pytest.raises(RuntimeError, match=r"\[M, 64\]"):
        kern.amx_linear(torch.randn(3, 32), tiles)
    with pytest.raises(RuntimeError, match="amx_pack"):
        kern.amx_linear(x, tiles.view(-1))
    with pytest.raises(RuntimeError, match="out"):
        kern.amx_linear(x, tiles, torch.zeros(x.shape[0] + 1, 64))
    with pytest.raises(RuntimeError, match="bias"):
        kern.amx_linear(x, tiles, bias=torch.zeros(63))
    assert kern.amx_linear(x[:0], tiles).shape == (0, 64)


def test_model_prompt_steps_on_tiles_are_the_float32_models(tiny_model, monkeypatch):
    """A q4 model whose prompt steps run on tiles gives the float32 weights' prompt
    logprobs (it computes them with the dense copy, as BLAS would), and the choice can be
    forced either way."""
    monkeypatch.setenv("KVPOOL_PROMPT_AMX", "1")
    q4 = LlamaModel(tiny_model.config, tiny_model.weights, torch.float32, "q4")
    layer = q4.layers[0]
    assert isinstance(layer.qkv, BlockLinear) and layer.qkv.large.amx is not None
    assert not layer.qkv.prompt_blocks  # prompt steps go to the dense layer, on tiles
    assert q4.lm_head.large.amx is None  # never the head
    f32 = LlamaModel(tiny_model.config, tiny_model.weights, torch.float32, "float32")
    assert isinstance(f32.layers[0].qkv, DenseLinear) and f32.layers[0].qkv.amx is not None
    ids = list(range(3, 60))
    monkeypatch.setenv("KVPOOL_PROMPT_AMX", "0")
    blas = LlamaModel(tiny_model.config, tiny_model.weights, torch.float32, "float32")
    assert blas.layers[0].qkv.amx is None
    want = next_token_logprobs(blas, ids)
    for model in (q4, f32):
        got = next_token_logprobs(model, ids)
        # 1e-4 to 4e-4 (seen) of logprobs of -10 to -35 on the tiny model's random weights,
        # ~1e-5 relative: the tiles' ~16 bits an operand (the 4-bit blocks: ~1e-1)
        assert (got - want).abs().max() < 1e-3
        # chunked, the attention kernels round otherwise (1e-7); the tiles add nothing to it
        assert torch.allclose(next_token_logprobs(model, ids, chunk=9), got, atol=1e-5)


def test_other_dtypes_never_take_the_tiles(tiny_model, monkeypatch):
    monkeypatch.setenv("KVPOOL_PROMPT_AMX", "1")  # asked for, yet the tiles take float32 only
    model = LlamaModel(tiny_model.config, tiny_model.weights, torch.bfloat16, "float32")
    assert model.layers[0].qkv.amx is None and not model.prompt_tiles


def test_autotune_measures_and_caches_the_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVPOOL_PROMPT_AMX", raising=False)
    monkeypatch.delenv("KVPOOL_PROMPT_BLOCKS", raising=False)
    calls = []
    real = autotune.measure_prompt_amx

    def spy(*a):
        calls.append(a)
        return real(*a)

    monkeypatch.setattr(autotune, "measure_prompt_amx", spy)
    first = autotune.prompt_amx(kern, "q4", 64, 96)
    assert autotune.prompt_amx(kern, "q4", 64, 96) == first and len(calls) == 1
    assert (tmp_path / "autotune" / "prompt_amx.json").is_file()
    # a choice made between the block kernel and BLAS is kept, unless tiles are asked for
    monkeypatch.setenv("KVPOOL_PROMPT_BLOCKS", "1")
    assert autotune.prompt_amx(kern, "q4", 64, 96) is False
    monkeypatch.setenv("KVPOOL_PROMPT_AMX", "1")
    assert autotune.prompt_amx(kern, "q4", 64, 96) is True
    assert autotune.prompt_amx(kern, "q4", 64, 40) is False  # N not a multiple of 16


def reference_attention(q, k, v, start_pos):
    """Causal attention in float64: query i sees keys 0 .. start_pos + i."""
    n, hq, d = q.shape
    g = hq // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, ctx, D]
    vv = v.double().repeat_interleave(g, dim=1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ kk.transpose(1, 2) * d**-0.5  # [Hq, n, ctx]
    seen = torch.arange(k.shape[0])[None, :] <= (start_pos + torch.arange(n))[:, None]
    p = s.masked_fill(~seen, float("-inf")).softmax(-1)
    return (p @ vv).transpose(0, 1)  # [n, Hq, D]


def qkv(n, ctx, hq=9, hkv=3, d=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(ctx, hkv, d, generator=g)
    v = torch.randn(ctx, hkv, d, generator=g)
    return q, k, v


@pytest.mark.parametrize(
    "n,start,hq,hkv,d",
    [(1, 0, 9, 3, 64), (37, 0, 9, 3, 64), (100, 29, 4, 2, 128), (64, 300, 8, 8, 32)],
)
def test_prompt_attention_is_float32s_to_rounding(n, start, hq, hkv, d):
    q, k, v = qkv(n, start + n, hq, hkv, d)
    got = kern.amx_prefill_attention(q, k, v, start, d**-0.5)
    want = reference_attention(q, k, v, start)
    # each operand kept to ~16 bits (two bfloat16 halves): ~1e-5 of outputs of ~1-4 (float32
    # SDPA: ~1e-6); with one bfloat16 product, ~100x further off
    assert (got.double() - want).abs().max() < 4e-5


def test_prompt_attention_rows_have_the_same_bits_in_any_chunking():
    n = 150
    q, k, v = qkv(n, n)
    whole = kern.amx_prefill_attention(q, k, v, 0, 0.125)
    for start, end in ((0, 1), (0, 40), (40, 41), (41, 97), (97, 150)):
        part = kern.amx_prefill_attention(q[start:end], k[:end], v[:end], start, 0.125)
        assert torch.equal(part, whole[start:end]), (start, end)
    # queries laid out as the model's q/k/v rows (heads contiguous, rows strided)
    rows = torch.cat([q.flatten(1), torch.randn(n, 384)], 1)[:, : 9 * 64].view(n, 9, 64)
    assert torch.equal(kern.amx_prefill_attention(rows, k, v, 0, 0.125), whole)


def test_prompt_attention_refuses_bad_shapes():
    q, k, v = qkv(8, 10)
    with pytest.raises(RuntimeError, match="start_pos"):
        kern.amx_prefill_attention(q, k, v, 0, 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        kern.amx_prefill_attention(
            q[..., :48], k[..., :48].contiguous(), v[..., :48].contiguous(), 2, 0.125
        )
    with pytest.raises(RuntimeError, match="query heads"):
        kern.amx_prefill_attention(q[:, :8], k, v, 2, 0.125)
    with pytest.raises(RuntimeError, match="contiguous"):
        kern.amx_prefill_attention(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, 2, 0.1)
    assert kern.amx_prefill_attention(q[:0], k[:2], v[:2], 2, 0.125).shape == (0, 9, 64)


def test_model_attends_on_tiles_where_its_prompt_linears_do(tiny_model, monkeypatch):
    monkeypatch.setenv("KVPOOL_PROMPT_AMX", "1")
    on = LlamaModel(tiny_model.config, tiny_model.weights, torch.float32, "q4")
    monkeypatch.setenv("KVPOOL_PROMPT_AMX", "0")
    off = LlamaModel(tiny_model.config, tiny_model.weights, torch.float32, "q4")
    assert on.prompt_tiles == (tiny_model.config.head_dim % 32 == 0) and not off.prompt_tiles


def test_a_real_prompt_on_tiles_is_the_block_kernels_to_rounding():
    """SmolLM2 (head size 64: its attention on tiles too) as served, against the same weights
    with every prompt step on the block kernel: perplexity within 0.01 % over 300 tokens of
    the quality text, and the same bits for a token whatever the chunking."""
    from pathlib import Path

    from kvpool.model.loader import load_model
    from kvpool.model.quality import block_path, perplexity

    loaded = load_model(None)
    text = (Path(__file__).resolve().parents[1] / "data" / "alice_ch1.txt").read_text()
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)[:300]
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, "q4", "auto", loaded.path)
    if not model.prompt_tiles:
        pytest.skip("this machine's autotune keeps the prompt steps off the tiles")
    served = next_token_logprobs(model, ids, served=True)
    with block_path(model):
        blocks = perplexity(model, ids)
    got = float(torch.exp(-served.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()))
    assert abs(got / blocks - 1) < 1e-4
    assert torch.equal(next_token_logprobs(model, ids, chunk=64, served=True), served)

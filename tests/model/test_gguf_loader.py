"""GGUF -> Hugging Face conversion on tiny synthetic files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import TinyModels, TinySpec, llama_cpp_permute

from kvpool.common.errors import ModelLoadError
from kvpool.model import loader
from kvpool.model.gguf_loader import hf_tensor_name, unpermute_rope
from kvpool.model.loader import load_model

Q = gguf.GGMLQuantizationType


def _entries(cache_dir: str) -> list[Path]:
    root = Path(cache_dir)
    return sorted(root.iterdir()) if root.exists() else []


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 2 * 3, dtype=np.float32).reshape(16, 3)
    for heads in (1, 2, 4):
        np.testing.assert_array_equal(unpermute_rope(llama_cpp_permute(w, heads), heads), w)
    bias = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rope(llama_cpp_permute(bias, 2), 2), bias)


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.11.attn_q.bias") == "model.layers.11.self_attn.q_proj.bias"
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.0.ssm_conv.weight") is None


@pytest.mark.parametrize("tie", [True, False])
def test_llama_round_trip(tmp_path: Path, tiny: TinyModels, cache_dir: str, tie: bool) -> None:
    spec = TinySpec(tie=tie)
    path = tmp_path / "Tiny-Llama.F32.gguf"
    expected = tiny.write_gguf(path, spec)
    model = load_model(str(path), cache_dir=cache_dir)
    c = model.config
    assert (c.name, c.num_layers, c.hidden_size, c.intermediate_size) == ("Tiny-Llama", 2, 64, 96)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 16, tiny.vocab_size)
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-5, 10000.0, 256)
    assert c.tie_word_embeddings is tie and c.attention_bias is False
    assert (c.bos_token_id, c.eos_token_ids) == (1, (0, 2))  # EOS + <|im_end|> of the template
    assert model.weights.keys() == expected.keys()
    for name, tensor in expected.items():  # exact: F32, and Q/K permutation undone
        assert model.weights[name].dtype == torch.float32
        torch.testing.assert_close(model.weights[name], tensor, rtol=0, atol=0, msg=name)
    assert model.path == str(path)
    assert model.fingerprint.startswith("tiny-llama-") and len(model.fingerprint) == 11 + 16


def test_qwen2_biases_not_permuted(tmp_path: Path, tiny: TinyModels, cache_dir: str) -> None:
    path = tmp_path / "tiny-qwen2.gguf"
    expected = tiny.write_gguf(path, TinySpec(arch="qwen2", pre="qwen2"))
    model = load_model(str(path), cache_dir=cache_dir)
    assert model.config.attention_bias is True
    assert "model.layers.1.self_attn.k_proj.bias" in model.weights
    for name, tensor in expected.items():
        torch.testing.assert_close(model.weights[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_1])
def test_quantized_tensors(tmp_path: Path, tiny: TinyModels, cache_dir: str, qtype: Q) -> None:
    path = tmp_path / "tiny-q.gguf"
    expected = tiny.write_gguf(path, TinySpec(qtype=qtype, hidden=64, inter=128))
    model = load_model(str(path), cache_dir=cache_dir)
    tolerance = {Q.F16: 1e-3, Q.Q8_0: 5e-3, Q.Q4_1: 0.05}[qtype]
    for name, tensor in expected.items():
        torch.testing.assert_close(model.weights[name], tensor, rtol=0, atol=tolerance, msg=name)


def test_bfloat16(tmp_path: Path, tiny: TinyModels, cache_dir: str) -> None:
    path = tmp_path / "tiny.gguf"
    expected = tiny.write_gguf(path, TinySpec())
    model = load_model(str(path), dtype=torch.bfloat16, cache_dir=cache_dir)
    name = "model.layers.0.self_attn.k_proj.weight"
    assert model.weights[name].dtype == torch.bfloat16
    torch.testing.assert_close(model.weights[name], expected[name].to(torch.bfloat16))


def test_second_load_uses_cache(
    tmp_path: Path, tiny: TinyModels, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    tiny.write_gguf(path, TinySpec())
    first = load_model(str(path), cache_dir=cache_dir)
    entries = list(Path(cache_dir).iterdir())
    assert len(entries) == 1 and (entries[0] / "config.json").is_file()

    def no_conversion(_path: Path) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    second = load_model(str(path), cache_dir=cache_dir)
    assert second.fingerprint == first.fingerprint
    assert list(Path(cache_dir).iterdir()) == entries


def test_cache_dir_from_env(
    tmp_path: Path, tiny: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    tiny.write_gguf(path, TinySpec())
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "env-cache"))
    load_model(str(path))
    assert len(list((tmp_path / "env-cache").iterdir())) == 1


def test_failed_conversion_leaves_no_cache(
    tmp_path: Path, tiny: TinyModels, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    tiny.write_gguf(path, TinySpec())

    def crash(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(loader, "write_hf_dir", crash)
    with pytest.raises(OSError, match="disk full"):
        load_model(str(path), cache_dir=cache_dir)
    assert _entries(cache_dir) == []


def test_unsupported_quant_type(tmp_path: Path, tiny: TinyModels, cache_dir: str) -> None:
    path = tmp_path / "tiny.gguf"
    raw = np.zeros((4, 66), dtype=np.uint8)  # one IQ2_XXS block (256 values) per row
    tiny.write_gguf(path, TinySpec(), extra_tensors={"blk.0.attn_gate.weight": (raw, Q.IQ2_XXS)})
    with pytest.raises(ModelLoadError, match=r"IQ2_XXS.*not supported; supported: .*Q4_1"):
        load_model(str(path), cache_dir=cache_dir)
    assert _entries(cache_dir) == []


def test_unknown_tensor(tmp_path: Path, tiny: TinyModels, cache_dir: str) -> None:
    path = tmp_path / "tiny.gguf"
    extra = {"blk.0.ssm_conv.weight": (np.zeros((2, 4), np.float32), Q.F32)}
    tiny.write_gguf(path, TinySpec(), extra_tensors=extra)
    with pytest.raises(ModelLoadError, match="ssm_conv"):
        load_model(str(path), cache_dir=cache_dir)


def test_rope_freqs_rejected(tmp_path: Path, tiny: TinyModels, cache_dir: str) -> None:
    path = tmp_path / "tiny.gguf"
    extra = {"rope_freqs.weight": (np.ones(8, np.float32), Q.F32)}
    tiny.write_gguf(path, TinySpec(), extra_tensors=extra)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_model(str(path), cache_dir=cache_dir)


def test_unsupported_architecture(tmp_path: Path, tiny: TinyModels, cache_dir: str) -> None:
    path = tmp_path / "tiny.gguf"
    tiny.write_gguf(path, TinySpec(arch="gemma"))
    with pytest.raises(ModelLoadError, match=r"'gemma' is not supported; supported: 'llama'"):
        load_model(str(path), cache_dir=cache_dir)


def test_truncated_gguf(tmp_path: Path, tiny: TinyModels, cache_dir: str) -> None:
    path = tmp_path / "tiny.gguf"
    tiny.write_gguf(path, TinySpec())
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(path), cache_dir=cache_dir)

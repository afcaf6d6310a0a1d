"""Load a Hugging Face-format folder: config.json, *.safetensors, tokenizer.json (+ its config)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvpool.common.errors import ModelLoadError
from kvpool.model.config import ModelConfig
from kvpool.model.tokenizer import Tokenizer, stop_token_ids

logger = logging.getLogger(__name__)

SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def read_optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def architecture_of(hf_config: dict[str, Any]) -> str:
    """The supported architecture class name of a config.json, or ``ModelLoadError``."""
    archs = hf_config.get("architectures") or [_MODEL_TYPES.get(hf_config.get("model_type", ""))]
    arch = archs[0]
    if arch not in SUPPORTED_HF_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {arch or hf_config.get('model_type')!r} is not supported; supported: "
            "LlamaForCausalLM (Llama, SmolLM, SmolLM2) and Qwen2ForCausalLM"
        )
    return arch


def _rope(hf_config: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling), from the transformers 4 or the 5 (rope_parameters) layout."""
    params = dict(hf_config.get("rope_parameters") or {})
    nested_theta = params.pop("rope_theta", None)
    theta = hf_config.get("rope_theta") or nested_theta or 10000.0
    scaling = hf_config.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def config_from_hf(
    hf_config: dict[str, Any], name: str, tokenizer: Tokenizer | None = None
) -> ModelConfig:
    """Our ``ModelConfig`` from a Hugging Face config.json dict."""
    arch = architecture_of(hf_config)
    try:
        hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
        theta, scaling = _rope(hf_config)
        return ModelConfig(
            name=name,
            vocab_size=hf_config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf_config["intermediate_size"],
            num_layers=hf_config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or heads,
            head_dim=hf_config.get("head_dim") or hidden // heads,
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=hf_config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf_config.get("attention_bias")),
            rope_scaling=scaling,
            bos_token_id=tokenizer.bos_token_id if tokenizer else hf_config.get("bos_token_id"),
            eos_token_ids=tokenizer.eos_token_ids
            if tokenizer
            else _ids(hf_config.get("eos_token_id")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json of {name!r} is incomplete or invalid: {exc!r}") from exc


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _token_id(backend: tokenizers.Tokenizer, token: str | dict | None) -> int | None:
    if isinstance(token, dict):  # serialized AddedToken
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def load_hf_tokenizer(folder: Path, hf_config: dict[str, Any]) -> Tokenizer:
    """Our ``Tokenizer`` from tokenizer.json, tokenizer_config.json and generation_config.json."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise ModelLoadError(f"{path}: cannot load tokenizer ({exc})") from exc
    tok_config = read_optional_json(folder / "tokenizer_config.json")
    gen_config = read_optional_json(folder / "generation_config.json")
    template = _chat_template(folder, tok_config)
    bos = gen_config.get("bos_token_id", hf_config.get("bos_token_id"))
    if bos is None:
        bos = _token_id(backend, tok_config.get("bos_token"))
    eos = _ids(gen_config.get("eos_token_id", hf_config.get("eos_token_id")))
    if not eos:
        eos = _ids(_token_id(backend, tok_config.get("eos_token")))
    pad = gen_config.get("pad_token_id", hf_config.get("pad_token_id"))
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=stop_token_ids(backend, eos, template),
        pad_token_id=pad if pad is not None else _token_id(backend, tok_config.get("pad_token")),
        chat_template=template,
        add_bos_token=bool(tok_config.get("add_bos_token", False)),
    )


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


def load_hf_weights(folder: Path, tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files (tied ``lm_head.weight`` dropped)."""
    files = _safetensors_files(folder)
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights |= load_file(file)
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from exc
    for name in [n for n in weights if n.endswith(_IGNORED_SUFFIXES)]:
        del weights[name]
    if tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights

"""Convert a GGUF file (llama / qwen2 architecture) to Hugging Face config, weights and tokenizer.

Tensors are dequantized to float32 with ``gguf.quants.dequantize``. llama.cpp's converter
permutes the rows of Q and K for llama-architecture models (its RoPE pairs dimension 2i with
2i+1, Hugging Face's ``rotate_half`` pairs i with i + head_dim/2); we undo that permutation, as
``transformers``' GGUF loader does, so the weights equal the original checkpoint's.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from kvpool.common.errors import ModelLoadError
from kvpool.model.gguf_tokenizer import build_gguf_tokenizer
from kvpool.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_QUANTS = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
    | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|TQ\d\w*|B?F16|F32)$", re.IGNORECASE)


@dataclass
class GGUFConversion:
    """What a GGUF file holds, in Hugging Face terms."""

    name: str
    hf_config: dict[str, Any]
    weights: dict[str, torch.Tensor]  # float32
    tokenizer: Tokenizer


def open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


def _scalar(field: gguf.ReaderField, index: int, kind: V) -> Any:
    part = field.parts[index]
    if kind == V.STRING:
        return bytes(part).decode("utf-8")
    value = part[0].item()
    if kind == V.FLOAT32:
        return float(str(np.float32(value)))  # shortest repr: 1e-05, not 9.9999997e-06
    return bool(value) if kind == V.BOOL else value


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """GGUF key/values as Python values (arrays as lists; nested arrays are skipped)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types or key.startswith("GGUF."):
            continue
        if field.types[0] != V.ARRAY:
            meta[key] = _scalar(field, field.data[0], field.types[0])
        elif len(field.types) == 2:
            meta[key] = [_scalar(field, i, field.types[1]) for i in field.data]
    return meta


def model_name(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return meta[key]


def _rope_scaling(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            "GGUF uses llama3-style RoPE frequency factors (rope_freqs), which cannot be "
            "converted back; load the Hugging Face folder of this model instead"
        )
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _require(meta, f"{arch}.rope.scaling.factor")}
    raise ModelLoadError(f"GGUF RoPE scaling {kind!r} is not supported (only linear)")


def _kv_heads(value: int | list[int]) -> int:
    if isinstance(value, list):  # per-layer counts
        if len(set(value)) != 1:
            raise ModelLoadError("GGUF with a different KV head count per layer is not supported")
        return value[0]
    return value


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict (LlamaForCausalLM / Qwen2ForCausalLM)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: 'llama' (Llama, SmolLM, "
            "SmolLM2) and 'qwen2'"
        )
    hidden = _require(meta, f"{arch}.embedding_length")
    heads = _require(meta, f"{arch}.attention.head_count")
    kv_heads = _kv_heads(meta.get(f"{arch}.attention.head_count_kv", heads))
    layers = _require(meta, f"{arch}.block_count")
    context = meta.get(f"{arch}.context_length", 2048)
    cfg: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": meta.get(f"{arch}.vocab_size")
        or len(_require(meta, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": _require(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": meta.get(f"{arch}.attention.key_length") or hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": _require(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch, tensor_names),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "qwen2":
        cfg |= {"use_sliding_window": False, "sliding_window": context, "max_window_layers": layers}
    return cfg


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None if unknown)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match[2] in _LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{suffix}"
    return None


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` of Q/K rows (weights or biases) for ``n_head`` heads."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_tensors(reader: gguf.GGUFReader) -> None:
    bad_types = sorted(
        {t.tensor_type.name for t in reader.tensors} - {q.name for q in SUPPORTED_QUANTS}
    )
    if bad_types:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_QUANTS))
        raise ModelLoadError(
            f"GGUF tensor types {bad_types} are not supported; supported: {supported}"
        )
    unknown = [t.name for t in reader.tensors if hf_tensor_name(t.name) is None]
    if unknown:
        raise ModelLoadError(f"GGUF has tensors this loader does not know: {unknown[:5]}")


def convert_tensors(reader: gguf.GGUFReader, hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 under its Hugging Face name, Q/K un-permuted."""
    _check_tensors(reader)
    permute = hf_config["model_type"] == "llama"
    heads = {
        "q_proj": hf_config["num_attention_heads"],
        "k_proj": hf_config["num_key_value_heads"],
    }
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        assert name is not None
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        proj = name.split(".")[-2]
        if permute and proj in heads:
            array = unpermute_rope(array, heads[proj])
        # Copy: F32 tensors come back as views of the memory-mapped file.
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32, copy=True, order="C"))
    return weights


def convert_gguf(path: Path) -> GGUFConversion:
    """Read ``path`` and return its config, float32 weights and tokenizer (slow: dequantizes)."""
    start = time.perf_counter()
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    hf_config = hf_config_from_gguf(meta, tensor_names)
    tokenizer = build_gguf_tokenizer(meta)
    logger.info("dequantizing %d GGUF tensors of %s", len(reader.tensors), path.name)
    weights = convert_tensors(reader, hf_config)
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
    return GGUFConversion(model_name(path), hf_config, weights, tokenizer)

"""Write a Hugging Face-format model folder that ``transformers`` and vLLM load offline."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvpool.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INFO_FILE = "kvpool.json"  # our own notes: fingerprint, name, source digest


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the generic fast tokenizer over our tokenizer.json."""
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.token_text(tokenizer.bos_token_id) or None,
        "eos_token": tokenizer.token_text(eos) or None,
        "pad_token": tokenizer.token_text(tokenizer.pad_token_id) or None,
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    return config


def generation_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """generation_config.json: which tokens start and end generation."""
    eos = list(tokenizer.eos_token_ids)
    config: dict[str, Any] = {"bos_token_id": tokenizer.bos_token_id}
    config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if tokenizer.pad_token_id is not None:
        config["pad_token_id"] = tokenizer.pad_token_id
    return config


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_hf_dir(
    out: Path,
    hf_config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    info: dict[str, Any],
) -> None:
    """Write config, weights (in their own dtype), tokenizer files and ``kvpool.json`` to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    write_json(out / "config.json", {**hf_config, "torch_dtype": dtype})
    tensors = {name: t.contiguous() for name, t in weights.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer.backend.save(str(out / "tokenizer.json"))
    max_len = hf_config.get("max_position_embeddings", 2048)
    write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, max_len))
    write_json(out / "generation_config.json", generation_config(tokenizer))
    write_json(out / INFO_FILE, info)
    logger.info("wrote Hugging Face folder %s (%d tensors, %s)", out, len(tensors), dtype)

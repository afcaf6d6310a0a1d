"""Our loader against Hugging Face transformers (the reference), on tiny and on the real model."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from tiny_models import TinyModels, TinySpec

from kvpool.model.loader import LoadedModel, export_hf, load_model

transformers = pytest.importorskip("transformers")
logger = logging.getLogger(__name__)

# Varied text; digits right after a run of spaces are left out on purpose: transformers' GGUF
# tokenizer ignores the 'smollm' pre-tokenizer (digits split first), llama.cpp and we do not.
TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "multiple     spaces inside",
    "tabs\tand\nnewlines\n\n\nend",
    "def f(x):\n    return x ** 2  # square\n",
    'for i in range(10): print(f"{i:03d}")',
    "héllo wörld ñ façade",
    "你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ",
    "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧‍👦",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "price: $1,234.56 or 3.14159e-10",
    "x 12345 y 2024-01-01",
    "I'm sure you're right, they'll see",
    "\r\n\r\n windows line endings",
    "A" * 64,
    "Mixed 中文 and English 混合",
    "@@@ ### !!! ??? ...",
    "<html><body class='x'>&amp;</body></html>",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "你好 😀"},
    ],
]


def _assert_same_weights(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], atol: float
) -> None:
    theirs = dict(theirs)
    if "lm_head.weight" not in ours:  # tied: transformers lists the shared tensor twice
        assert torch.equal(theirs.pop("lm_head.weight"), theirs["model.embed_tokens.weight"])
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        other = theirs[name]
        assert tensor.shape == other.shape and other.dtype == torch.float32, name
        assert (tensor - other).abs().max().item() <= atol, name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers(
    tmp_path: Path, tiny: TinyModels, cache_dir: str, arch: str
) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    tiny.write_gguf(
        path, TinySpec(arch=arch, tie=arch == "llama", pre="qwen2" if arch == "qwen2" else "smollm")
    )
    ours = load_model(str(path), cache_dir=cache_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    _assert_same_weights(ours.weights, reference.state_dict(), atol=0)
    out = export_hf(str(path), str(tmp_path / "export"), cache_dir=cache_dir)
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    _assert_same_weights(ours.weights, exported.state_dict(), atol=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == ours.tokenizer.encode(text)


@pytest.mark.slow
def test_tokenizer_matches_transformers(real_model: LoadedModel, hf_gguf_tokenizer) -> None:
    tok = real_model.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.encode(text, add_special_tokens=True) == hf_gguf_tokenizer.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert tok.vocab_size == len(hf_gguf_tokenizer) == 49152
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))


@pytest.mark.slow
def test_chat_template_matches_transformers(real_model: LoadedModel, hf_gguf_tokenizer) -> None:
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            expected = hf_gguf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=prompt, tokenize=False
            )
            assert real_model.tokenizer.apply_chat_template(messages, prompt) == expected


@pytest.mark.slow
def test_weights_match_transformers_gguf(real_model: LoadedModel, hf_gguf_state_dict) -> None:
    assert real_model.config.tie_word_embeddings
    _assert_same_weights(real_model.weights, hf_gguf_state_dict, atol=1e-6)


@pytest.mark.slow
def test_export_loads_in_transformers(
    tmp_path: Path, real_model: LoadedModel, real_cache_dir: str
) -> None:
    out = export_hf(None, str(tmp_path / "smollm2"), cache_dir=real_cache_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    _assert_same_weights(real_model.weights, model.state_dict(), atol=0)
    assert model.generation_config.eos_token_id == 2
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == real_model.tokenizer.encode(text)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = real_model.tokenizer.apply_chat_template(messages)
    assert prompt == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([real_model.tokenizer.encode(prompt)])
    generated = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert "Paris" in real_model.tokenizer.decode(generated.tolist())


@pytest.mark.slow
def test_cached_load(real_model: LoadedModel, real_cache_dir: str) -> None:
    start = time.perf_counter()
    again = load_model(
        "HuggingFaceTB/SmolLM2-135M-Instruct", dtype=torch.bfloat16, cache_dir=real_cache_dir
    )
    logger.info("cached load of SmolLM2 took %.2f s", time.perf_counter() - start)
    assert again.fingerprint == real_model.fingerprint
    assert again.fingerprint.startswith("smollm2-135m-instruct-")
    assert again.weights["model.norm.weight"].dtype == torch.bfloat16

"""The engine on the real SmolLM2-135M-Instruct weights against HF transformers (float32)."""

import pytest
import torch

from kvpool import LLM, SamplingParams

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash function is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish, German and Italian, then explain the differences "
    "in how each greeting is used during the day, with one example sentence each.",
]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # float32 weights: the engine's logic against transformers on the very same arithmetic
    # (the quantized formats' own figures: tests/model/test_quality_real_model.py)
    return LLM(
        dtype="float32",
        weights="float32",
        kv_cache_memory_bytes="256MiB",
        max_num_batched_tokens=512,
    )


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    out = []
    for i, q in enumerate(QUESTIONS):
        if i == 4:
            out.append(tok.encode(q))  # a raw completion prompt
        else:
            out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])))
    return out


@pytest.fixture(scope="module")
def hf_tokens(llm, prompts):
    from kvpool.model.loader import ensure_converted

    folder = ensure_converted(__import__("pathlib").Path(llm.engine.loaded.path))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_alone_equals_transformers(llm, prompts, hf_tokens):
    llm.engine.reset_prefix_cache()
    for p, want in zip(prompts, hf_tokens, strict=True):
        assert tokens(llm.generate([p], GREEDY))[0] == want


def test_greedy_in_mixed_batch_equals_transformers(llm, prompts, hf_tokens):
    llm.engine.reset_prefix_cache()
    assert len({len(p) for p in prompts}) == len(prompts)  # mixed lengths
    assert tokens(llm.generate(prompts, GREEDY)) == hf_tokens


def test_prefix_hit_equals_cold(llm, prompts, hf_tokens):
    llm.engine.reset_prefix_cache()
    llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert tokens(again) == hf_tokens
    for p, o in zip(prompts, again, strict=True):  # every full prompt block (16 tokens) hits
        assert o.num_cached_tokens == (len(p) - 1) // 16 * 16


def test_chunked_prefill_equals_one_shot(prompts, hf_tokens, llm):
    chunked = LLM(
        dtype="float32",
        weights="float32",
        kv_cache_memory_bytes="128MiB",
        max_num_batched_tokens=13,
        enable_prefix_caching=False,
        loaded_model=llm.engine.loaded,
    )
    assert tokens(chunked.generate(prompts, GREEDY)) == hf_tokens


def test_chat_answers_sensibly(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=30),
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended by <|im_end|>, the model's EOS

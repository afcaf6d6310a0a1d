"""Logprobs on the real SmolLM2-135M-Instruct weights against HF transformers' ``log_softmax``
of its own logits: prompt logprobs (what ``echo`` returns, and lm-eval sums) and the logprobs
of greedy tokens, with float32 weights and with the default weights (the GGUF's own blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool import LLM, SamplingParams

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

TEXTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Alice was beginning to get very tired of sitting by her sister on the bank. " * 12,
]
# measured (max |ours - transformers| over the prompts): float32 weights 2.2e-5 (the same
# arithmetic up to the order of float32 sums); the default weights (the GGUF's 4-bit blocks)
# 8e-4 for prompts and 2e-4 for greedy tokens: batches of few rows (a chunk's tail, the head's
# last pass over a prompt, decode steps) run the block kernel, whose 16-bit activations move
# logits by ~1e-4
TOL = {"float32": 2e-4, "auto": 3e-3}
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["float32", "auto"])
def llm(request):
    # 512 tokens a step: the long prompt (~200 tokens x 1) is one chunk, so chunks are also
    # tested: a second engine with 64-token chunks
    return LLM(weights=request.param, kv_cache_memory_bytes="256MiB",
               max_num_batched_tokens=512), request.param  # fmt: skip


@pytest.fixture(scope="module")
def hf(llm):
    from kvpool.model.loader import ensure_converted

    folder = ensure_converted(Path(llm[0].engine.loaded.path))
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_match_transformers(llm, hf):
    engine, weights = llm
    tok = engine.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    outs = engine.generate(prompts, params)
    worst = 0.0
    for ids, out in zip(prompts, outs, strict=True):
        ref = hf_logprobs(hf, ids)
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(ids)
        for j in range(1, len(ids)):
            d = got[j]
            worst = max(worst, abs(d[ids[j]].logprob - ref[j - 1, ids[j]].item()))
            top = ref[j - 1].topk(5)
            for v, i in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if i in d:
                    worst = max(worst, abs(d[i].logprob - v))
        # lm-eval's number: the sum over a continuation
        cont = sum(got[j][ids[j]].logprob for j in range(len(ids) // 2, len(ids)))
        want = sum(ref[j - 1, ids[j]].item() for j in range(len(ids) // 2, len(ids)))
        assert cont == pytest.approx(want, abs=TOL[weights] * len(ids))
    print(f"max |prompt logprob - transformers| ({weights}): {worst:.2e}")
    assert worst < TOL[weights]


def test_chunked_prompt_equals_one_chunk(llm):
    engine, weights = llm
    tok = engine.get_tokenizer()
    ids = tok.encode(TEXTS[2])
    assert len(ids) > 64 * 2
    chunked = LLM(loaded_model=engine.engine.loaded, weights=weights,
                  kv_cache_memory_bytes="64MiB", max_num_batched_tokens=64)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    a = engine.generate([ids], params)[0].prompt_logprobs
    b = chunked.generate([ids], params)[0].prompt_logprobs
    chunked.engine.close()
    diffs = [abs(a[j][ids[j]].logprob - b[j][ids[j]].logprob) for j in range(1, len(ids))]
    assert max(diffs) < TOL[weights]


def test_greedy_token_logprobs_match_transformers(llm, hf):
    engine, weights = llm
    tok = engine.get_tokenizer()
    ids = tok.encode(TEXTS[0])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    out = engine.generate([ids], params)[0].outputs[0]
    ref = hf_logprobs(hf, ids + out.token_ids)
    worst = 0.0
    for k, (t, d) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        pos = len(ids) - 1 + k
        worst = max(worst, abs(d[t].logprob - ref[pos, t].item()))
        assert d[t].rank == 1  # greedy: the most likely token
        assert int(ref[pos].argmax()) == t
    print(f"max |sampled logprob - transformers| ({weights}): {worst:.2e}")
    assert worst < TOL[weights]

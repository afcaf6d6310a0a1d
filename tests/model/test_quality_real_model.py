"""What the quantized weight formats cost in quality on the real SmolLM2-135M-Instruct weights,
measured (issue 15): perplexity on a fixed public-domain text (tests/data/alice_ch1.txt, 2,898
tokens) and agreement with the float32 model's greedy tokens, both through the block kernel
(``quality.block_path``: what decode steps compute). The figures are printed (``-s``) and
recorded in docs/benchmarks.md.
"""

from pathlib import Path

import pytest
import torch

from kvpool import LLM
from kvpool.engine.quality import greedy_runs, tokens_before_parting
from kvpool.model.kernels import kernels
from kvpool.model.llama import LlamaModel
from kvpool.model.quality import agreement, block_path, next_token_logprobs

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(kernels() is None, reason="no C++ compiler for the kernels")]  # fmt: skip
TEXT = Path(__file__).parents[1] / "data" / "alice_ch1.txt"


@pytest.fixture(scope="module")
def reference(real_model):
    return LlamaModel(real_model.config, real_model.weights, torch.float32, "float32")


@pytest.fixture(scope="module")
def text_ids(real_model) -> list[int]:
    return real_model.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)


@pytest.fixture(scope="module")
def reference_logprobs(reference, text_ids) -> torch.Tensor:
    """The float32 model's next-token log-probabilities over the text (computed once for
    both weight formats)."""
    return next_token_logprobs(reference, text_ids)


def _ppl(lp: torch.Tensor, ids: list[int]) -> float:
    return float(torch.exp(-lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()))


@pytest.mark.parametrize(("fmt", "min_top1"), [("q4", 0.995), ("int8", 0.95)])
def test_perplexity_within_one_percent_of_float32(real_model, text_ids, reference_logprobs,
                                                  fmt, min_top1):  # fmt: skip
    ids, ref_lp = text_ids, reference_logprobs
    model = LlamaModel(real_model.config, real_model.weights, torch.float32, fmt,
                       source=real_model.path)  # fmt: skip
    with block_path(model):
        lp = next_token_logprobs(model, ids)
    ref_ppl, ppl = _ppl(ref_lp, ids), _ppl(lp, ids)
    top1 = float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean())
    print(f"\n{fmt}: perplexity {ppl:.4f} vs float32 {ref_ppl:.4f} ({ppl / ref_ppl - 1:+.3%}), "
          f"top-1 agreement {top1:.4f} over {len(ids) - 1} positions")  # fmt: skip
    assert abs(ppl / ref_ppl - 1) <= 0.01
    assert top1 >= min_top1


def test_greedy_tokens_agree_with_float32(real_model, reference):
    """8 prompts x 256 greedy tokens from the quantized engine (``weights="auto"``, q4 here)
    against the float32 engine's: the length they agree for, and how often the quantized model
    picks float32's token when both read float32's text (teacher forcing)."""
    runs = greedy_runs(real_model, [("float32", "auto"), ("auto", "auto")], 8, 256)
    prompts, outs = runs["prompts"], runs["tokens"]
    common = tokens_before_parting(outs[("float32", "auto")], outs[("auto", "auto")])
    quant = LlamaModel(real_model.config, real_model.weights, torch.float32, "q4",
                       source=real_model.path)  # fmt: skip
    rates = []  # where the answers part, is it one near-tie or a different model?
    with block_path(quant):
        for p, ref, n in zip(prompts, outs[("float32", "auto")], common, strict=True):
            if n < 256:
                rates.append(agreement(quant, reference, p + ref, len(p))["top1_agreement"])
    print(f"\nq4 vs float32 greedy: equal for {common} of 256 tokens; teacher-forced top-1 "
          f"agreement {[round(r, 4) for r in rates]}")  # fmt: skip
    assert min(rates, default=1.0) >= 0.98
    assert sum(n == 256 for n in common) >= 4  # most answers are token for token float32's


def test_int8_kv_perplexity_on_a_long_prompt(real_model, reference):
    """2,898 tokens read in chunks of 128: every chunk after the first attends to the earlier
    tokens' int8 keys and values, as a long chunked prompt or a decode does."""
    ids = real_model.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    assert len(ids) >= 1500
    int8 = LlamaModel(real_model.config, real_model.weights, torch.float32, "float32", "int8")
    ref_lp = next_token_logprobs(reference, ids, chunk=128)
    lp = next_token_logprobs(int8, ids, chunk=128)
    ref_ppl, ppl = _ppl(ref_lp, ids), _ppl(lp, ids)
    top1 = float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean())
    print(f"\nint8 KV: perplexity {ppl:.4f} vs float32 KV {ref_ppl:.4f} "
          f"({ppl / ref_ppl - 1:+.3%}), top-1 agreement {top1:.4f}")  # fmt: skip
    assert abs(ppl / ref_ppl - 1) <= 0.01
    assert top1 >= 0.95


def test_the_files_own_blocks_share_the_float32_namespace(real_model):
    """q4 from the GGUF's blocks computes the float32 model (to float rounding), so its KV is
    shared with float32 engines (and vLLM); int8 requantizes, and an int8 cache differs."""

    def namespace(**kw):
        llm = LLM(loaded_model=real_model, kv_cache_memory_bytes="64MiB", **kw)
        llm.engine.close()
        return llm.engine.namespace

    base = namespace(weights="float32")
    assert namespace(weights="q4") == base
    assert namespace(weights="int8") != base
    assert namespace(weights="q4", kv_cache_dtype="int8") != base

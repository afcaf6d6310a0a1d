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
from kvpool.model import linear
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


# q4 is the file's own weights: with 16-bit activations its prompt path is float32 to rounding;
# 8-bit activations (KVPOOL_PROMPT_ACT8=1, linear.PROMPT_ACT8) move near-ties
@pytest.mark.parametrize(("fmt", "act8", "min_top1"),
                         [("q4", False, 0.995), ("q4", True, 0.96), ("int8", True, 0.95)])  # fmt: skip
def test_perplexity_within_one_percent_of_float32(real_model, text_ids, reference_logprobs,
                                                  fmt, act8, min_top1, monkeypatch):  # fmt: skip
    monkeypatch.setattr(linear, "PROMPT_ACT8", act8)
    ids, ref_lp = text_ids, reference_logprobs
    model = LlamaModel(real_model.config, real_model.weights, torch.float32, fmt,
                       source=real_model.path)  # fmt: skip
    with block_path(model):
        lp = next_token_logprobs(model, ids)
    ref_ppl, ppl = _ppl(ref_lp, ids), _ppl(lp, ids)
    top1 = float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean())
    print(f"\n{fmt} ({8 if act8 else 16}-bit prompt activations): perplexity {ppl:.4f} vs float32 {ref_ppl:.4f} ({ppl / ref_ppl - 1:+.3%}), "
          f"top-1 agreement {top1:.4f} over {len(ids) - 1} positions")  # fmt: skip
    assert abs(ppl / ref_ppl - 1) <= 0.01
    assert top1 >= min_top1


def test_greedy_tokens_agree_with_float32(real_model, reference, monkeypatch):
    """8 prompts x 256 greedy tokens from the quantized engine (``weights="auto"``, q4 here)
    against the float32 engine's: the length they agree for, and how often the quantized model
    picks float32's token when both read float32's text (teacher forcing). With 16-bit prompt
    activations (the default) q4 is float32 to rounding; 8-bit ones part on near-ties sooner."""
    monkeypatch.setattr(linear, "PROMPT_ACT8", False)
    runs = greedy_runs(real_model, [("float32", "auto"), ("auto", "auto")], 8, 256)
    prompts, ref_out = runs["prompts"], runs["tokens"][("float32", "auto")]
    quant = LlamaModel(real_model.config, real_model.weights, torch.float32, "q4",
                       source=real_model.path)  # fmt: skip
    bounds = {False: (0.98, 4), True: (0.95, 1)}  # (teacher-forced top-1, sequences all equal)
    for act8 in (False, True):
        monkeypatch.setattr(linear, "PROMPT_ACT8", act8)
        out = runs["tokens"][("auto", "auto")] if not act8 else (
            greedy_runs(real_model, [("auto", "auto")], 8, 256)["tokens"][("auto", "auto")])  # fmt: skip
        common = tokens_before_parting(ref_out, out)
        rates = []  # where the answers part, is it one near-tie or a different model?
        with block_path(quant):
            for p, ref, n in zip(prompts, ref_out, common, strict=True):
                if n < 256:
                    rates.append(agreement(quant, reference, p + ref, len(p))["top1_agreement"])
        print(f"\nq4 ({8 if act8 else 16}-bit prompt activations) vs float32 greedy: equal for "
              f"{common} of 256 tokens; teacher-forced top-1 agreement "
              f"{[round(r, 4) for r in rates]}")  # fmt: skip
        min_rate, min_equal = bounds[act8]
        assert min(rates, default=1.0) >= min_rate
        assert sum(n == 256 for n in common) >= min_equal


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


def test_8_bit_prompt_activations_get_a_namespace_of_their_own(real_model, monkeypatch):
    """KVPOOL_PROMPT_ACT8=1: a prompt's KV is no longer the float32 model's, so it is kept
    apart from it; float32 weights (no block kernel) are unaffected."""

    def namespace(**kw):
        llm = LLM(loaded_model=real_model, kv_cache_memory_bytes="64MiB", **kw)
        llm.engine.close()
        return llm.engine.namespace

    # prompt steps on the block kernel (not BLAS, not AMX tiles), whatever this CPU prefers
    monkeypatch.setenv("KVPOOL_PROMPT_BLOCKS", "1")
    monkeypatch.setenv("KVPOOL_PROMPT_AMX", "0")
    monkeypatch.setattr(linear, "PROMPT_ACT8", False)
    base = namespace(weights="float32")
    monkeypatch.setattr(linear, "PROMPT_ACT8", True)
    assert namespace(weights="float32") == base
    assert namespace(weights="q4") != base

"""Greedy agreement between weight and KV formats, measured through the engine itself (the
tokens a server generates); the model-level figures (perplexity, top-1 agreement) are in
``kvpool.model.quality``."""

from __future__ import annotations

from kvpool.engine.llm import LLM
from kvpool.engine.sampling import SamplingParams
from kvpool.model.quality import PROMPTS


def greedy_runs(loaded, formats: list[tuple[str, str]], prompts: int, new_tokens: int) -> dict:
    """Greedy tokens (EOS ignored) of the first ``prompts`` chat prompts, from an engine per
    ``(weights, kv_cache_dtype)`` in ``formats``: ``{format: [token ids per prompt]}``."""
    tok = loaded.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
           for p in PROMPTS[:prompts]]  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    out = {}
    for weights, kv in formats:
        llm = LLM(loaded_model=loaded, weights=weights, kv_cache_dtype=kv,
                  kv_cache_memory_bytes="256MiB")  # fmt: skip
        out[(weights, kv)] = [o.outputs[0].token_ids for o in llm.generate(ids, sp)]
        llm.engine.close()
    return {"prompts": ids, "tokens": out}


def tokens_before_parting(reference: list[list[int]], other: list[list[int]]) -> list[int]:
    """Per sequence, how many leading tokens two runs share."""
    return [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(reference, other, strict=True)]  # fmt: skip

"""What a weight format costs in quality, measured: perplexity on a text and agreement with the
float32 model's greedy tokens.

Both read a model's next-token distributions over a whole token sequence in one pass (teacher
forcing). A quantized model runs its prompt steps through float32 BLAS and only its decode steps
through the block kernel (``weight_formats.py``), so ``block_path`` makes every batch take
the block kernel while measuring: the figures are those of the tokens a server generates.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvpool.model.attention import AttentionMetadata, PrefillSeq
from kvpool.model.kernels import kernels
from kvpool.model.kv_layout import kv_shape
from kvpool.model.linear import BlockLinear
from kvpool.model.llama import LlamaModel

_ROWS = 256  # logits computed this many positions at a time (vocab-sized rows are big)
# chat prompts of the greedy-agreement measurement (benchmarks/bench_quality.py, the tests)
PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for pancakes.",
    "Describe the water cycle to a ten-year-old.",
    "def quicksort(xs):",
    "List five facts about the Moon.",
    "Why is the sky blue?",
)


@contextmanager
def block_path(model: LlamaModel) -> Iterator[LlamaModel]:
    """Every batch of ``model`` through the block kernel while inside, prompt steps included
    (a no-op for float32): the dense fallback is set aside."""
    saved = [(lin, lin.large) for lin in model.linears() if isinstance(lin, BlockLinear)]
    try:
        for lin, _ in saved:
            lin.large = None
        yield model
    finally:
        for lin, large in saved:
            lin.large = large


@torch.inference_mode()
def next_token_logprobs(model: LlamaModel, ids: list[int], chunk: int = 0,
                        block: int = 16, served: bool = False) -> torch.Tensor:  # fmt: skip
    """Log-probabilities ``[len(ids) - 1, vocab]`` of each next token, from a causal pass over
    ``ids`` with a scratch KV cache of the model's KV format. ``chunk``: tokens per forward
    (0: all at once); every chunk after the first reads the earlier tokens' keys and values
    from the cache, as a chunked prefill or a decode does (what an int8 cache costs).
    ``served``: with the compiled kernels as the engine's steps have them (its RoPE, RMSNorm
    and, where the prompt linears run on AMX tiles, the attention on tiles), not torch's ops."""
    mod = kernels() if served else None
    n = len(ids)
    if n < 2:
        raise ValueError("need at least two tokens")
    num_blocks = -(-n // block) + 1
    kv = torch.zeros(kv_shape(model.cfg, num_blocks, block, model.kv_dtype), dtype=model.kv_dtype)
    table = torch.arange(1, num_blocks)
    step = chunk or n
    outs = []
    for start in range(0, n, step):
        end = min(n, start + step)
        pos = torch.arange(start, end)
        mask = None if start == 0 else torch.arange(end).unsqueeze(0) <= pos.unsqueeze(1)
        seq = PrefillSeq(0, end - start, start, table[: -(-end // block)], mask)
        meta = AttentionMetadata(table[pos // block], pos % block, 0, None, None, None, [seq],
                                 mod)  # fmt: skip
        outs.append(model.forward(torch.tensor(ids[start:end]), pos, meta, kv))
    hidden = torch.cat(outs)[:-1]
    parts = [torch.log_softmax(model.logits(hidden[i : i + _ROWS], prompt=True), dim=-1)
             for i in range(0, n - 1, _ROWS)]  # fmt: skip
    return torch.cat(parts)


def perplexity(model: LlamaModel, ids: list[int]) -> float:
    lp = next_token_logprobs(model, ids)
    nll = -lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item()
    return math.exp(nll)


def agreement(model: LlamaModel, reference: LlamaModel, ids: list[int], start: int) -> dict:
    """How often ``model``'s greedy next token equals ``reference``'s over ``ids[start:]``
    (both reading the same tokens), and the mean KL divergence from the reference."""
    lp, ref = (
        next_token_logprobs(model, ids)[start - 1 :],
        next_token_logprobs(reference, ids)[start - 1 :],
    )
    same = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
    return {"top1_agreement": same, "kl": kl, "positions": int(lp.shape[0])}

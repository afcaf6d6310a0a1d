"""Sampling parameters (vLLM's names) and the batched sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpool.common.errors import BadRequestError

_GREEDY_EPS = 1e-5
MAX_N = 16  # sequences per request (``n``)
MAX_LOGPROBS = 20  # most likely tokens returned per position (OpenAI's limit for top_logprobs)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens; field names follow ``vllm.SamplingParams`` so scripts port as is."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # per output token: its logprob and the top ``logprobs``
    prompt_logprobs: int | None = None  # the same for every prompt token (the first: None)
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise BadRequestError(f"n must be an integer in [1, {MAX_N}]", param="n")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise BadRequestError("seed must be an integer that fits in 64 bits", param="seed")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise BadRequestError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}]", param=name
                )
        if not 0.0 <= self.temperature <= 100.0:
            raise BadRequestError("temperature must be in [0, 100]", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequestError("top_p must be in (0, 1]", param="top_p")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise BadRequestError("top_k must be -1 (off) or a positive number", param="top_k")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise BadRequestError("max_tokens must be at least 1", param="max_tokens")
        if self.min_tokens < 0:
            raise BadRequestError("min_tokens must be >= 0", param="min_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise BadRequestError("stop must be a non-empty string or a list of them", param="stop")
        self._stop = tuple(stop)
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise BadRequestError(
                "stop_token_ids must be non-negative integers", param="stop_token_ids"
            )
        self.stop_token_ids = ids

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def sequence_seed(seed: int | None, index: int) -> int | None:
    """The seed of sequence ``index`` of a request seeded with ``seed`` (vLLM's ``seed + i``,
    wrapped into torch's range), so sequence i of seed s does not depend on the others."""
    if seed is None:
        return None
    s = seed + index
    return s - 2**64 if s >= 2**64 else s


def make_generator(seed: int | None) -> torch.Generator | None:
    """A per-request generator when a seed is given, so its samples do not depend on batching."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Pick one token per row of ``logits`` ([N, vocab], float32)."""
    out = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    for i in rows:
        out[i] = _sample_row(logits[i], params[i], generators[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row.float() / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p > p.top_p  # keep the smallest set whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())

"""Log probabilities of sampled and prompt tokens, in vLLM's shapes.

A position's logprobs are a ``dict[token id, Logprob]``: the token that is there (sampled, or
the prompt's next token) first, then the ``k`` most likely tokens in rank order (so up to k + 1
entries), as vLLM's ``SampleLogprobs`` / ``PromptLogprobs``. Values are ``log_softmax`` of the
model's raw logits (vLLM's default ``logprobs_mode="raw_logprobs"``): before temperature,
top-k and top-p, so they do not depend on the sampling settings. Ranks count the tokens at
least as likely (vLLM's rank: 1 is the most likely).

Nothing here runs for a request that does not ask: the runner calls it only for the rows of
requests with ``logprobs`` / ``prompt_logprobs`` set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PROMPT_LOGITS_ROWS = 128  # prompt positions per pass over the vocabulary: [128, vocab] floats


@dataclass(slots=True)
class Logprob:
    """One token's log probability at one position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


def logprob_dicts(
    logits: torch.Tensor, token_ids: list[int], ks: list[int]
) -> list[PositionLogprobs]:
    """Per row of ``logits`` ([R, vocab]): the logprob and rank of ``token_ids[r]``, then the
    ``ks[r]`` most likely tokens."""
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)
    chosen = lp.gather(1, ids)
    ranks = (lp >= chosen).sum(dim=1).tolist()
    chosen_l = chosen.squeeze(1).tolist()
    kmax = max(ks)
    top_v: list[list[float]] = [[] for _ in token_ids]
    top_i: list[list[int]] = [[] for _ in token_ids]
    if kmax > 0:
        top = lp.topk(kmax, dim=1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    out = []
    for r, tok in enumerate(token_ids):
        d = {tok: Logprob(chosen_l[r], ranks[r])}
        for j in range(ks[r]):
            if top_i[r][j] not in d:
                d[top_i[r][j]] = Logprob(top_v[r][j], j + 1)
        out.append(d)
    return out


def prompt_logprob_dicts(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
) -> list[PositionLogprobs]:
    """Logprobs of ``targets[j]`` after position j, from the hidden states ``hidden[j]``;
    ``logits_of`` (the model's head) runs over at most ``PROMPT_LOGITS_ROWS`` rows at a time, so
    a long chunk never holds its whole [positions, vocab] logits at once."""
    out: list[PositionLogprobs] = []
    for a in range(0, len(targets), PROMPT_LOGITS_ROWS):
        b = min(a + PROMPT_LOGITS_ROWS, len(targets))
        out.extend(logprob_dicts(logits_of(hidden[a:b]), targets[a:b], [k] * (b - a)))
    return out


class TokenDecoder:
    """Each token's text alone (vLLM's ``decoded_token``: special tokens kept), cached."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id])
        return text

    def fill(self, positions: list[PositionLogprobs | None]) -> None:
        """Set ``decoded_token`` of every entry."""
        for d in positions:
            for tok, lp in (d or {}).items():
                if lp.decoded_token is None:
                    lp.decoded_token = self(tok)

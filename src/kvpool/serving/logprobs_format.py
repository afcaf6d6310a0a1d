"""The engine's logprobs (``engine/logprobs.py``) in OpenAI's two shapes.

Completions (the legacy shape, ``logprobs: k``): ``{tokens, token_logprobs, top_logprobs,
text_offset}``, where ``top_logprobs[i]`` maps token texts to logprobs for the token there and
the ``k`` most likely ones (up to k + 1 entries, as OpenAI documents), ``None`` where nothing
precedes the token (the first prompt token under ``echo``). Chat (``logprobs: true,
top_logprobs: k``): ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]}`` with exactly the k most likely tokens, most likely first.

Token texts are each token decoded alone (special tokens kept), as vLLM gives them; a token
that is part of a character reads as U+FFFD, and its ``bytes`` are its own bytes where the
vocabulary is byte-level. ``text_offset`` adds up those texts' lengths (vLLM's). Logprobs are
clamped at -9999.0 (vLLM's), so JSON never carries -inf.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from kvpool.engine.logprobs import PositionLogprobs, TokenDecoder

FLOOR = -9999.0


def clamp(x: float) -> float:
    return FLOOR if math.isnan(x) else max(x, FLOOR)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (``bytes_to_unicode``): character -> the byte it stands for."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs = list(bs)
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes map to themselves
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenStrings:
    """Texts and bytes of single tokens of one tokenizer (cached)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.text = TokenDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        self._byte_level = bool(getattr(tokenizer, "concatenative", False))
        self._special = self._specials(tokenizer)
        self._bytes: dict[int, list[int]] = {}

    @staticmethod
    def _specials(tokenizer) -> frozenset[str]:
        backend = getattr(tokenizer, "backend", None)
        try:
            return frozenset(t.content for t in backend.get_added_tokens_decoder().values())
        except AttributeError:
            return frozenset()

    def decode(self, token_ids: Sequence[int]) -> str:
        """A sequence's text (special tokens kept)."""
        return self._tok.decode(list(token_ids), skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        got = self._bytes.get(token_id)
        if got is None:
            got = self._bytes[token_id] = self._raw_bytes(token_id)
        return got

    def _raw_bytes(self, token_id: int) -> list[int]:
        text = self.text(token_id)
        if self._byte_level:
            piece = self._tok.token_text(token_id)
            table = _byte_decoder()
            if piece and piece not in self._special and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(text.encode("utf-8", errors="replace"))


def completion_logprobs(strings: TokenStrings, token_ids: Sequence[int],
                        positions: Sequence[PositionLogprobs | None],
                        offset: int = 0) -> dict:  # fmt: skip
    """The legacy ``choices[i].logprobs`` object; ``offset``: ``text_offset`` of the first."""
    tokens, values, tops, offsets = [], [], [], []
    for tok, d in zip(token_ids, positions, strict=True):
        text = strings.text(tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if d is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(clamp(d[tok].logprob))
        tops.append({strings.text(t): clamp(lp.logprob) for t, lp in d.items()})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def chat_logprobs(strings: TokenStrings, token_ids: Sequence[int],
                  positions: Sequence[PositionLogprobs | None], k: int) -> dict:  # fmt: skip
    """The chat ``choices[i].logprobs`` object (``{"content": [...]}``)."""
    content = []
    for tok, d in zip(token_ids, positions, strict=True):
        if d is None:
            continue
        entry = _chat_entry(strings, tok, d[tok].logprob)
        # ``d``: the token, then the k most likely (the token among them, or not: k + 1)
        top = [(t, lp) for t, lp in d.items() if t != tok or len(d) <= k]
        top.sort(key=lambda kv: -kv[1].logprob)
        entry["top_logprobs"] = [_chat_entry(strings, t, lp.logprob) for t, lp in top[:k]]
        content.append(entry)
    return {"content": content, "refusal": None}


def _chat_entry(strings: TokenStrings, token_id: int, logprob: float) -> dict:
    return {"token": strings.text(token_id), "logprob": clamp(logprob),
            "bytes": strings.bytes(token_id)}  # fmt: skip

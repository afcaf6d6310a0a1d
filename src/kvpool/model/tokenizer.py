"""The tokenizer used at run time: a ``tokenizers.Tokenizer`` plus the model's special tokens and
chat template, and an incremental detokenizer for streaming.

Built either from GGUF metadata (``gguf_tokenizer.py``) or from a Hugging Face folder
(``hf_loader.py``); ``transformers`` is never needed at run time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers

from kvpool.model.chat_template import ChatTemplate

# Tokens that end an assistant turn in common chat formats; one counts as a stop token when the
# chat template uses it (llama.cpp treats the same spellings as end-of-generation tokens).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
)


def stop_token_ids(
    backend: tokenizers.Tokenizer, declared: Iterable[int | None], chat_template: str | None
) -> tuple[int, ...]:
    """The declared EOS ids, then any end-of-turn token the chat template writes, deduplicated."""
    ids = [i for i in declared if i is not None]
    for text in END_OF_TURN_TOKENS if chat_template else ():
        token_id = backend.token_to_id(text)
        if token_id is not None and text in chat_template:
            ids.append(token_id)
    return tuple(dict.fromkeys(ids))


class Tokenizer:
    """Text <-> token ids for one model, with its chat template and stop tokens."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self._chat_template = chat_template
        self._compiled: ChatTemplate | None = None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token spells (bounds how much text a token count holds)."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (the EOS and the chat format's end-of-turn token)."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_text(self, token_id: int | None) -> str:
        """The vocabulary entry of ``token_id`` ("" for None or an unknown id)."""
        if token_id is None:
            return ""
        return self.backend.id_to_token(token_id) or ""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self._bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    @property
    def concatenative(self) -> bool:
        """Whether decoding a sequence gives the concatenation of its tokens decoded alone
        (byte-level BPE: a token's text does not depend on its neighbours, short of a
        character split across tokens). SentencePiece-style decoders are not: they drop the
        leading space of a sequence's first token."""
        import json

        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        return decoder.get("type") == "ByteLevel"

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for ``messages`` (encode it with ``add_special_tokens=False``)."""
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            eos = self._eos_token_ids[0] if self._eos_token_ids else None
            self._compiled = ChatTemplate(
                self._chat_template,
                bos_token=self.token_text(self._bos_token_id),
                eos_token=self.token_text(eos),
            )
        return self._compiled.render(messages, add_generation_prompt, **kwargs)


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas, decoding only a short window per step.

    Keeps two offsets into the ids (as vLLM and TGI do): text up to ``read_offset`` has been
    emitted; decoding from ``prefix_offset`` gives the context that makes the new tokens decode
    the same as in the full sequence. A delta that ends in U+FFFD (an incomplete UTF-8 sequence)
    is held back until the following tokens complete it.
    """

    _PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or ())
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - self._PROMPT_CONTEXT, 0)
        self._start = self._read_offset
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (the prompt excluded)."""
        return "".join(self._pieces)

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._start :]

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete ("" when nothing is complete yet)."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(delta)
        return delta

    def finish(self) -> str:
        """Emit whatever is still held back (e.g. a truncated multi-byte character)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        if delta:
            self._pieces.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

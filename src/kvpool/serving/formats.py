"""OpenAI response bodies and stream chunks for text completions and chat completions.

One response answers every prompt of a request and every sequence of each (``n``): choice
``prompt_index * n + i``, as OpenAI numbers them; ``usage`` counts each prompt once and every
sequence's tokens. A ``_Format`` instance belongs to one response (fixed id and timestamp).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.engine.logprobs import PositionLogprobs
from kvpool.engine.request import CompletionOutput, RequestOutput
from kvpool.serving.logprobs_format import TokenStrings, chat_logprobs, completion_logprobs

_OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


@dataclass(slots=True, frozen=True)
class ResponseOptions:
    """What the client asked to see, beyond what is sampled."""

    include_usage: bool = False  # a last stream chunk with ``usage``
    echo: bool = False  # completions: the prompt before each answer
    prompt_only: bool = False  # echo with ``max_tokens: 0``: the prompt alone, nothing generated
    sent: int = 0  # answer tokens already streamed by the conductor (see ``usage``)
    top_logprobs: int = 0  # chat: how many of the most likely tokens each position lists


def usage(outs: Sequence[RequestOutput], opts: ResponseOptions = ResponseOptions()) -> dict:
    """The ``usage`` object, with the prefix-cache hits as ``prompt_tokens_details``; ``sent``
    leading tokens of the prompt are really the answer's first ones (produced by the prefill
    worker, streamed by the conductor)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs) - opts.sent
    completion = 0
    if not opts.prompt_only:
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs) + opts.sent
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)},
    }


def finish_reason(out: CompletionOutput) -> str | None:
    """OpenAI's finish reason of one choice (an aborted or failed one reads ``stop``)."""
    reason = out.finish_reason
    return None if reason is None else _OPENAI_FINISH.get(reason, reason)


def sse(obj: dict | str) -> str:
    """One server-sent event carrying ``obj`` (a dict as compact JSON, or a literal)."""
    data = (
        obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


@dataclass(slots=True)
class Delta:
    """New output of one choice for a stream chunk: text, and the tokens (with their
    logprobs, when asked) it came from; ``offset``: ``text_offset`` of the first token."""

    index: int
    text: str
    token_ids: Sequence[int] = ()
    logprobs: Sequence[PositionLogprobs | None] | None = None
    finish: str | None = None
    offset: int = 0


class _Format:
    """Shapes of one endpoint's responses; one instance per response."""

    object_full = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, model: str, opts: ResponseOptions | None = None, id: str | None = None,
                 created: int | None = None, strings: TokenStrings | None = None) -> None:  # fmt: skip
        """``strings``: token texts and bytes (needed for logprobs)."""
        self.id = id or f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.opts = opts or ResponseOptions()
        self.strings = strings

    @property
    def include_usage(self) -> bool:
        return self.opts.include_usage

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def _chunk(self, choice: dict) -> dict:
        body = self._envelope(self.object_chunk, [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> dict:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage(outs, self.opts)
        return body

    def full(self, outs: Sequence[RequestOutput]) -> dict:
        """The whole response to the request whose prompts gave ``outs`` (in prompt order)."""
        choices = []
        for p, out in enumerate(outs):
            n = len(out.outputs)
            choices += [self.choice(p * n + o.index, out, o) for o in out.outputs]
        body = self._envelope(self.object_full, choices)
        body["usage"] = usage(outs, self.opts)
        return body

    def first_chunks(self, num_choices: int = 1) -> list[dict]:
        return []

    def choice(self, index: int, out: RequestOutput, o: CompletionOutput) -> dict:
        raise NotImplementedError

    def delta_chunks(self, delta: Delta) -> list[dict]:
        raise NotImplementedError


class CompletionFormat(_Format):
    """``text_completion`` objects."""

    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def choice(self, index: int, out: RequestOutput, o: CompletionOutput) -> dict:
        text, ids, lps = o.text, o.token_ids, o.logprobs
        reason = finish_reason(o)
        if self.opts.echo:
            if self.opts.prompt_only:  # the one token generated is not shown
                text, ids, reason = "", [], "length"
                lps = [] if lps is not None else None
            text = echo_text(self, out) + text
            ids = [*out.prompt_token_ids, *ids]
            if lps is not None:
                lps = [*(out.prompt_logprobs or [None] * len(out.prompt_token_ids)), *lps]
        return {"index": index, "text": text, "logprobs": self._logprobs(ids, lps),
                "finish_reason": reason}  # fmt: skip

    def _logprobs(self, ids: Sequence[int], lps, offset: int = 0) -> dict | None:
        if lps is None or self.strings is None:
            return None
        return completion_logprobs(self.strings, ids, lps, offset)

    def delta_chunks(self, delta: Delta) -> list[dict]:
        if not delta.text and delta.finish is None and not delta.token_ids:
            return []
        lps = self._logprobs(delta.token_ids, delta.logprobs, delta.offset)
        return [self._chunk({"index": delta.index, "text": delta.text, "logprobs": lps,
                             "finish_reason": delta.finish})]  # fmt: skip


class ChatFormat(_Format):
    """``chat.completion`` objects and ``chat.completion.chunk`` deltas."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, index: int, out: RequestOutput, o: CompletionOutput) -> dict:
        message = {"role": "assistant", "content": o.text, "refusal": None}
        return {"index": index, "message": message,
                "logprobs": self._logprobs(o.token_ids, o.logprobs),
                "finish_reason": finish_reason(o)}  # fmt: skip

    def _logprobs(self, ids: Sequence[int], lps) -> dict | None:
        if lps is None or self.strings is None:
            return None
        return chat_logprobs(self.strings, ids, lps, self.opts.top_logprobs)

    def first_chunks(self, num_choices: int = 1) -> list[dict]:
        return [self._delta(i, {"role": "assistant", "content": ""}, None, None)
                for i in range(num_choices)]  # fmt: skip

    def delta_chunks(self, delta: Delta) -> list[dict]:
        lps = self._logprobs(delta.token_ids, delta.logprobs)
        chunks = []
        if delta.text or (lps and lps["content"]):
            chunks.append(self._delta(delta.index, {"content": delta.text}, lps, None))
        if delta.finish is not None:
            chunks.append(self._delta(delta.index, {}, None, delta.finish))
        return chunks

    def _delta(self, index: int, delta: dict, lps: dict | None, finish: str | None) -> dict:
        return self._chunk({"index": index, "delta": delta, "logprobs": lps,
                            "finish_reason": finish})  # fmt: skip


def echo_text(fmt: _Format, out: RequestOutput) -> str:
    """The prompt as echoed: the client's text, else its token ids decoded."""
    if out.prompt is not None:
        return out.prompt
    if fmt.strings is None:
        return ""
    return fmt.strings.decode(out.prompt_token_ids)

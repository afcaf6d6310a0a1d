"""OpenAI response bodies and stream chunks for text completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid

from kvpool.engine.request import RequestOutput

_OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


def usage(out: RequestOutput, sent: int = 0) -> dict:
    """The ``usage`` object, with the prefix-cache hit as ``prompt_tokens_details``; ``sent``:
    leading tokens of the prompt that are really the answer's first ones (produced by the
    prefill worker, streamed by the conductor)."""
    prompt = len(out.prompt_token_ids) - sent
    completion = len(out.outputs[0].token_ids) + sent
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def finish_reason(out: RequestOutput) -> str | None:
    reason = out.outputs[0].finish_reason
    return None if reason is None else _OPENAI_FINISH.get(reason, reason)


def sse(obj: dict | str) -> str:
    """One server-sent event carrying ``obj`` (a dict as compact JSON, or a literal)."""
    data = (
        obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


class _Format:
    """Shapes of one endpoint's responses; one instance per request (fixed id and timestamp)."""

    object_full = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, model: str, include_usage: bool = False, id: str | None = None,
                 created: int | None = None, sent: int = 0) -> None:  # fmt: skip
        self.id = id or f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.include_usage = include_usage
        self.sent = sent  # answer tokens already streamed by someone else (see ``usage``)

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

    def usage_chunk(self, out: RequestOutput) -> dict:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage(out, self.sent)
        return body

    def first_chunks(self) -> list[dict]:
        return []

    def full(self, out: RequestOutput) -> dict:
        raise NotImplementedError

    def delta_chunks(self, delta: str, finish: str | None) -> list[dict]:
        raise NotImplementedError


class CompletionFormat(_Format):
    """``text_completion`` objects."""

    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def full(self, out: RequestOutput) -> dict:
        choice = {
            "index": 0,
            "text": out.outputs[0].text,
            "logprobs": None,
            "finish_reason": finish_reason(out),
        }
        body = self._envelope(self.object_full, [choice])
        body["usage"] = usage(out, self.sent)
        return body

    def delta_chunks(self, delta: str, finish: str | None) -> list[dict]:
        if not delta and finish is None:
            return []
        return [self._chunk({"index": 0, "text": delta, "logprobs": None, "finish_reason": finish})]


class ChatFormat(_Format):
    """``chat.completion`` objects and ``chat.completion.chunk`` deltas."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def full(self, out: RequestOutput) -> dict:
        message = {"role": "assistant", "content": out.outputs[0].text, "refusal": None}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason(out),
        }
        body = self._envelope(self.object_full, [choice])
        body["usage"] = usage(out, self.sent)
        return body

    def first_chunks(self) -> list[dict]:
        return [self._delta({"role": "assistant", "content": ""}, None)]

    def delta_chunks(self, delta: str, finish: str | None) -> list[dict]:
        chunks = [self._delta({"content": delta}, None)] if delta else []
        if finish is not None:
            chunks.append(self._delta({}, finish))
        return chunks

    def _delta(self, delta: dict, finish: str | None) -> dict:
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})

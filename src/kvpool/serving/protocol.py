"""Request bodies of the OpenAI API (completions, chat) and their conversion to SamplingParams.

Fields follow the OpenAI names plus vLLM's sampling extensions (``top_k``, ``stop_token_ids``,
``ignore_eos``, ...). Unknown fields are ignored, as OpenAI clients send some we do not use.
Types are checked strictly (``"5"`` is not a number) so that a mistake is a 400, not a guess.
Lists and strings that cost work per item are capped (``MAX_*``); the body as a whole is capped
by the server (``HttpLimits.max_body_bytes``), the prompt by the model's context length.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from kvpool.common.errors import BadRequestError
from kvpool.engine.sampling import SamplingParams

MAX_STOPS = 64  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
MAX_NAME_CHARS = 256  # model names, roles, content part types

_Stop = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
_Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: _Name | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, max_tokens_param: str) -> SamplingParams:
        if self.n not in (None, 1):
            raise BadRequestError("only n=1 is supported", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise BadRequestError(f"{max_tokens_param} must be at least 1", param=max_tokens_param)
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise BadRequestError("seed must fit in 64 bits", param="seed")
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise BadRequestError("the prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return p  # type: ignore[return-value]
        if len(p) > 1:
            raise BadRequestError("only one prompt per request is supported", param="prompt")
        return p[0]  # type: ignore[return-value]

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise BadRequestError("echo is not supported", param="echo")
        if self.logprobs is not None:
            raise BadRequestError("logprobs are not supported", param="logprobs")
        if self.suffix:
            raise BadRequestError("suffix is not supported", param="suffix")
        return self._sampling_params(self.max_tokens, "max_tokens")


class ContentPart(_Body):
    type: _Name
    text: str | None = None


class ChatMessage(_Body):
    role: _Name
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None

    def text(self) -> str:
        """The message's text; list content is the concatenation of its text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise BadRequestError(
                    f"content part of type {part.type!r} is not supported (only text)",
                    param="messages",
                )
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template expects them: ``[{"role", "content"}]``."""
        if not self.messages:
            raise BadRequestError("messages must not be empty", param="messages")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        if self.logprobs or self.top_logprobs:
            raise BadRequestError("logprobs are not supported", param="logprobs")
        if self.max_completion_tokens is not None:
            return self._sampling_params(self.max_completion_tokens, "max_completion_tokens")
        return self._sampling_params(self.max_tokens, "max_tokens")


_M = TypeVar("_M", bound=BaseModel)


def parse_request(body: bytes, model: type[_M]) -> _M:
    """Validate a JSON body into ``model``; any problem is a BadRequestError (HTTP 400)."""
    if not body.strip():
        raise BadRequestError("the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _field_path(err: dict) -> tuple[list[str], bool]:
    """The error's field path without pydantic's union-member tags, and whether it had one."""
    loc = [x for x in err.get("loc", ()) if x != "body"]
    for i, seg in enumerate(loc):
        if isinstance(seg, str) and (seg in _TYPE_TAGS or "[" in seg or seg[:1].isupper()):
            return [str(x) for x in loc[:i]], True
    return [str(x) for x in loc], False


def validation_error(errors: list) -> BadRequestError:
    """A BadRequestError describing the first of pydantic's (or FastAPI's) validation errors."""
    if not errors:
        return BadRequestError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return BadRequestError(f"invalid JSON in the request body: {first.get('msg', '')}")
    path, union = _field_path(first)
    if not path:
        return BadRequestError(f"the request body must be a JSON object ({first.get('msg')})")
    msg = "field required" if first.get("type") == "missing" else first.get("msg", "invalid")
    same = 1
    if union:  # every member of a union failed: one problem, not several
        msg = f"matches none of the accepted types (first: {msg})"
        same = sum(1 for e in errors if _field_path(e)[0] == path)
    more = f" (and {len(errors) - same} more problems)" if len(errors) > same else ""
    return BadRequestError(f"{'.'.join(path)}: {msg}{more}", param=path[0])

"""Request bodies of the OpenAI API (completions, chat) and their conversion to SamplingParams.

Fields follow the OpenAI names plus vLLM's sampling extensions (``top_k``, ``stop_token_ids``,
``ignore_eos``, ...). Unknown fields are ignored, as OpenAI clients send some we do not use.
Types are checked strictly (``"5"`` is not a number) so that a mistake is a 400, not a guess.
Lists and strings that cost work per item are capped (``MAX_*``); the body as a whole is capped
by the server (``HttpLimits.max_body_bytes``), the prompt by the model's context length.

A completions request may carry several prompts (``prompt: [str, ...]`` or ``[[ids], ...]``)
and ask for ``n`` sequences of each: its choices are numbered ``prompt_index * n + i``.
``echo`` puts the prompt before each answer; with ``logprobs`` it asks for the prompt's
logprobs too (``prompt_logprobs``), and with ``max_tokens: 0`` for the prompt alone.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from kvpool.common.errors import BadRequestError
from kvpool.engine.sampling import MAX_LOGPROBS, MAX_N, SamplingParams
from kvpool.protocol.decode import MAX_PROMPTS  # prompts per completions request

MAX_CHOICES = 256  # prompts x n
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

    @property
    def num_sequences(self) -> int:
        return 1 if self.n is None else self.n

    def _sampling_params(self, max_tokens: int | None, max_tokens_param: str,
                         logprobs: int | None = None) -> SamplingParams:  # fmt: skip
        if not 1 <= self.num_sequences <= MAX_N:
            raise BadRequestError(f"n must be in [1, {MAX_N}]", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise BadRequestError(f"{max_tokens_param} must be at least 1", param=max_tokens_param)
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise BadRequestError("seed must fit in 64 bits", param="seed")
        return SamplingParams(
            n=self.num_sequences,
            logprobs=logprobs,
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

    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of this request (texts or token ids), at least one, at most
        ``MAX_PROMPTS``, with at most ``MAX_CHOICES`` choices in all."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            out: list = [p]
        else:
            out = list(p)
        if not out or any(not x for x in out):
            raise BadRequestError("the prompt is empty", param="prompt")
        if len(out) * self.num_sequences > MAX_CHOICES:
            raise BadRequestError(f"at most {MAX_CHOICES} choices (prompts x n) per request",
                                  param="n")  # fmt: skip
        return out

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (text or token ids)."""
        prompts = self.prompts()
        if len(prompts) > 1:
            raise BadRequestError("only one prompt per request is supported", param="prompt")
        return prompts[0]

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the answer is the prompt (with its logprobs)."""
        return bool(self.echo) and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise BadRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.num_sequences:
            raise BadRequestError("best_of is not supported (other than best_of = n)",
                                  param="best_of")  # fmt: skip
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise BadRequestError("max_tokens must be at least 1 (0 only with echo)",
                                  param="max_tokens")  # fmt: skip
        # echo without generation runs one token, never shown (as vLLM does)
        max_tokens = 1 if self.prompt_only else self.max_tokens
        params = self._sampling_params(max_tokens, "max_tokens", self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs
        return params


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
        k = self.top_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise BadRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]",
                                  param="top_logprobs")  # fmt: skip
        if k and not self.logprobs:
            raise BadRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (k or 0) if self.logprobs else None
        if self.max_completion_tokens is not None:
            return self._sampling_params(self.max_completion_tokens, "max_completion_tokens",
                                         logprobs)  # fmt: skip
        return self._sampling_params(self.max_tokens, "max_tokens", logprobs)


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

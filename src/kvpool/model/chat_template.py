"""Rendering of Hugging Face style Jinja chat templates in a sandbox.

Mirrors what ``transformers`` does (trim_blocks, lstrip_blocks, loop controls, a ``tojson`` that
does not escape HTML, ``raise_exception`` and ``strftime_now`` globals), so that a prompt rendered
here is byte-identical to ``tokenizer.apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvpool.common.errors import BadRequestError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _compile(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"invalid chat template: {exc}") from exc

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages``; a template's ``raise_exception`` becomes a ``BadRequestError``."""
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.exceptions.TemplateError as exc:
            raise BadRequestError(f"chat template rejected the messages: {exc}") from exc

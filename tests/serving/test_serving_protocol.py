"""Request models: conversion to SamplingParams and the one-prompt rule."""

from __future__ import annotations

import pytest

from kvpool.common.errors import BadRequestError
from kvpool.serving.protocol import ChatCompletionRequest, CompletionRequest, parse_request


def test_completion_to_sampling_params():
    req = CompletionRequest(
        prompt="x",
        temperature=0,
        top_k=5,
        top_p=0.5,
        seed=3,
        stop="END",
        stop_token_ids=[7],
        ignore_eos=True,
        min_tokens=2,
    )
    p = req.to_sampling_params()
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (0, 5, 0.5, 3)
    assert p.max_tokens == 16 and p.min_tokens == 2 and p.ignore_eos
    assert p.stop_strings == ("END",) and p.stop_token_ids == [7]
    defaults = CompletionRequest(prompt="x").to_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (1.0, 1.0, -1)


def test_chat_max_tokens_precedence():
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=msgs).to_sampling_params().max_tokens is None
    req = ChatCompletionRequest(messages=msgs, max_tokens=5, max_completion_tokens=9)
    assert req.to_sampling_params().max_tokens == 9
    assert ChatCompletionRequest(messages=msgs, max_tokens=5).to_sampling_params().max_tokens == 5


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("abc", "abc"), ([1, 2], [1, 2]), (["abc"], "abc"), ([[4, 5]], [4, 5])],
)
def test_single_prompt(prompt, expected):
    assert CompletionRequest(prompt=prompt).single_prompt() == expected


def test_several_prompts_rejected_where_one_is_expected():
    with pytest.raises(BadRequestError, match="only one prompt"):
        CompletionRequest(prompt=["a", "b"]).single_prompt()


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("abc", ["abc"]),
        ([1, 2], [[1, 2]]),
        (["a", "b"], ["a", "b"]),
        ([[4], [5, 6]], [[4], [5, 6]]),
    ],
)
def test_prompts(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_logprobs_echo_and_n_to_sampling_params():
    p = CompletionRequest(prompt="x", logprobs=3, n=4, best_of=4).to_sampling_params()
    assert (p.logprobs, p.prompt_logprobs, p.n) == (3, None, 4)
    req = CompletionRequest(prompt="x", logprobs=1, echo=True, max_tokens=0)
    p = req.to_sampling_params()
    assert (p.logprobs, p.prompt_logprobs, p.max_tokens, req.prompt_only) == (1, 1, 1, True)
    p = CompletionRequest(prompt="x", echo=True).to_sampling_params()
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    msgs = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=5, n=2)
    assert (chat.to_sampling_params().logprobs, chat.to_sampling_params().n) == (5, 2)
    assert ChatCompletionRequest(messages=msgs, logprobs=True).to_sampling_params().logprobs == 0
    assert ChatCompletionRequest(messages=msgs).to_sampling_params().logprobs is None


def test_content_parts_and_null_content():
    req = parse_request(
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}, {"role": "assistant", "content": null}],'
        b' "tools": [], "response_format": {"type": "text"}}',
        ChatCompletionRequest,
    )
    assert req.chat_messages() == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]


def test_strict_types():
    with pytest.raises(BadRequestError) as e:
        parse_request(b'{"prompt": "x", "max_tokens": "5"}', CompletionRequest)
    assert e.value.param == "max_tokens"
    with pytest.raises(BadRequestError) as e:
        parse_request(b'{"prompt": "x", "max_tokens": true}', CompletionRequest)
    assert e.value.param == "max_tokens"
    assert parse_request(b'{"prompt": "x", "temperature": 1}', CompletionRequest).temperature == 1

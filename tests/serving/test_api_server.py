"""The OpenAI endpoints over the tiny model: shapes, streaming, usage, prefix-cache hits."""

from __future__ import annotations

import pytest
from serving_helpers import sse_events

# Sampling at a high temperature with a seed gives varied but reproducible text on the tiny model
# (greedy repeats one token).
VARIED = {"temperature": 50.0, "seed": 0, "ignore_eos": True}


def _usage_ok(usage: dict) -> None:
    assert set(usage) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["object"] == "model"
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.get("/v1/models/other").status_code == 404


def test_completion(client):
    r = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-") and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("length", "stop")
    _usage_ok(body["usage"])
    assert body["usage"]["prompt_tokens"] == len("Hello there")  # byte-level tokenizer
    assert body["usage"]["completion_tokens"] <= 5


def test_completion_defaults_and_prompt_forms(client):
    # No model, default max_tokens (16), token-id prompt, a list with one string; extras ignored.
    r = client.post(
        "/v1/completions",
        json={"prompt": [71, 68, 75], "ignore_eos": True, "user": "me", "frequency_penalty": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["usage"]["prompt_tokens"] == 3
    r = client.post("/v1/completions", json={"prompt": ["Hi"], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_chat_completion(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
    ]
    r = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 4, **VARIED}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    _usage_ok(body["usage"])
    assert body["usage"]["completion_tokens"] == 4
    # ChatML around both messages, plus the generation prompt
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    expected = len(rendered) - 3 * (len("<|im_start|>") - 1) - 2 * (len("<|im_end|>") - 1)
    assert body["usage"]["prompt_tokens"] == expected


def _stream(client, path: str, payload: dict) -> list:
    with client.stream("POST", path, json={**payload, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def test_completion_stream_matches_non_stream(client):
    payload = {"prompt": "Once upon a time", "max_tokens": 12, **VARIED}
    full = client.post("/v1/completions", json=payload).json()
    events = _stream(client, "/v1/completions", payload)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks)  # no include_usage
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


def test_chat_stream_shape_with_usage(client):
    payload = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "stream_options": {"include_usage": True},
        **VARIED,
    }
    full = client.post("/v1/chat/completions", json=payload).json()
    events = _stream(client, "/v1/chat/completions", payload)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in events[:-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chunks[-1]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"
    middle = [c["choices"][0] for c in chunks[1:-1]]
    assert all(set(c["delta"]) == {"content"} and c["finish_reason"] is None for c in middle)
    assert (
        "".join(c["delta"]["content"] for c in middle) == full["choices"][0]["message"]["content"]
    )
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 6
    assert usage_chunk["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream):
    base = {"prompt": "The end", "max_tokens": 16, **VARIED}
    text = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    i = next(
        i
        for i in range(3, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].isprintable()
    )
    stop = text[i : i + 2]
    payload = {**base, "stop": [stop, "\x00never"]}
    if stream:
        events = _stream(client, "/v1/completions", payload)[:-1]
        got = "".join(c["choices"][0]["text"] for c in events)
        reason = events[-1]["choices"][0]["finish_reason"]
    else:
        choice = client.post("/v1/completions", json=payload).json()["choices"][0]
        got, reason = choice["text"], choice["finish_reason"]
    assert got == text[: text.find(stop)]
    assert reason == "stop"


def test_repeated_prompt_hits_prefix_cache(client):
    prompt = "A long shared prefix that spans several KV blocks of four tokens each. " * 2
    payload = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.post("/v1/completions", json=payload).json()["usage"]
    second = client.post("/v1/completions", json=payload).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 4 == 0 and cached < second["prompt_tokens"]
    assert cached >= second["prompt_tokens"] - 8


def test_no_prefix_caching(make_app):
    from fastapi.testclient import TestClient

    _, app = make_app(enable_prefix_caching=False)
    payload = {"prompt": "x" * 40, "max_tokens": 1}
    with TestClient(app) as c:
        for _ in range(2):
            usage = c.post("/v1/completions", json=payload).json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_internal_generate_takes_tokens_and_reports_the_given_cached_tokens(client):
    """The conductor's typed path: token ids in (no tokenization), the prefill's cached
    tokens out in usage, the same tokens as the public API for the same prompt."""
    ids = list(range(5, 25))
    public = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 4,
                                                   "temperature": 0}).json()  # fmt: skip
    body = {"request_id": "d1", "kind": "completion", "token_ids": ids,
            "params": {"max_tokens": 4, "temperature": 0.0}, "cached_tokens": 16}  # fmt: skip
    r = client.post("/internal/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == public["choices"][0]["text"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    stream = client.post("/internal/generate", json={**body, "stream": True,
                                                     "include_usage": True, "kind": "chat"})  # fmt: skip
    assert stream.status_code == 200
    events = [e for e in sse_events(stream.text.splitlines()) if e != "[DONE]"]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events
                   if e.get("choices")) == public["choices"][0]["text"]  # fmt: skip


def test_internal_generate_goes_on_from_a_first_token_already_streamed(client):
    """The conductor streamed the answer's first token (from the prefill): the decode worker
    sends the rest under the same id, without the opening chunk, and counts all of them."""
    ids = list(range(5, 25))
    public = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6,
                                                   "temperature": 0}).json()  # fmt: skip
    tok = client.app.state.server.client.engine.tokenizer
    first = tok.encode(public["choices"][0]["text"], add_special_tokens=False)[0]
    body = {"request_id": "d2", "kind": "chat", "token_ids": ids, "stream": True,
            "include_usage": True, "params": {"max_tokens": 6, "temperature": 0.0},
            "first_token": first, "response_id": "chatcmpl-given", "created": 1700000000}  # fmt: skip
    r = client.post("/internal/generate", json=body)
    assert r.status_code == 200, r.text
    events = [e for e in sse_events(r.text.splitlines()) if e != "[DONE]"]
    assert {e["id"] for e in events} == {"chatcmpl-given"}
    assert {e["created"] for e in events} == {1700000000}
    assert all("role" not in e["choices"][0]["delta"] for e in events if e.get("choices"))
    rest = "".join(e["choices"][0]["delta"].get("content", "") for e in events
                   if e.get("choices"))  # fmt: skip
    assert tok.decode([first]) + rest == public["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert events[-1]["usage"]["prompt_tokens"] == len(ids)
    r = client.post("/internal/generate", json={**body, "params": {"max_tokens": 1}})
    assert r.status_code == 400  # nothing left to go on with


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"request_id": "x", "kind": "chat", "token_ids": [], "params": {}}',
        b'{"request_id": "x", "kind": "chat", "token_ids": [1], "params": {"nope": 1}}',
        b'{"request_id": "x", "kind": "chat", "token_ids": [1], "params": {"top_p": "a"}}',
        b'{"request_id": "x", "kind": "chat", "token_ids": [99999999], "params": {}}',
        b'{"request_id": "x", "kind": "chat", "token_ids": [1], "params": {}, "kv_handle": 5}',
    ],
)
def test_internal_generate_rejects_bad_requests_with_400(client, body):
    r = client.post("/internal/generate", content=body,
                    headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"]


def test_internal_generate_takes_only_the_internal_bearer(tiny_engine_factory):
    """With a cluster token, an API key opens /v1 but not the route that reads KV handles."""
    from fastapi.testclient import TestClient

    from kvpool.engine.async_engine import AsyncLLMEngine
    from kvpool.serving.api_server import build_app

    aeng = AsyncLLMEngine(tiny_engine_factory(num_threads=1)).start()
    try:
        app = build_app(aeng, "tiny", api_keys=["internal", "api-key"],
                        internal_keys=["internal"])  # fmt: skip
        body = {"request_id": "d", "kind": "completion", "token_ids": [5, 6, 7],
                "params": {"max_tokens": 2}}  # fmt: skip
        with TestClient(app, raise_server_exceptions=False) as c:
            api = {"Authorization": "Bearer api-key"}
            assert c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1},
                          headers=api).status_code == 200  # fmt: skip
            denied = c.post("/internal/generate", json=body, headers=api)
            assert denied.status_code == 403 and denied.json()["error"]["type"]
            ok = c.post("/internal/generate", json=body,
                        headers={"Authorization": "Bearer internal"})  # fmt: skip
            assert ok.status_code == 200, ok.text
    finally:
        aeng.shutdown()

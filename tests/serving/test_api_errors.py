"""Every bad input gets the right status and the OpenAI error shape; failures never hang."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from serving_helpers import assert_openai_error, sse_events

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPL, {}, "prompt"),
        (CHAT, {"max_tokens": 3}, "messages"),
        (COMPL, {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        (COMPL, {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        (COMPL, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPL, {"prompt": "x", "stream": "yes"}, "stream"),
        (COMPL, {"prompt": 42}, "prompt"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": [{"content": "no role"}]}, "messages"),
        (COMPL, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPL, {"prompt": "x", "max_tokens": -3}, "max_tokens"),
        (CHAT, {"messages": MSGS, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
        (COMPL, {"prompt": "x", "n": 17}, "n"),
        (COMPL, {"prompt": "x", "n": 0}, "n"),
        (COMPL, {"prompt": "x", "n": -1}, "n"),
        (COMPL, {"prompt": "x", "n": "2"}, "n"),
        (CHAT, {"messages": MSGS, "n": 1000}, "n"),
        (COMPL, {"prompt": ["a"] * 20, "n": 16}, "n"),  # 320 choices
        (COMPL, {"prompt": ["a"] * 129}, "prompt"),
        (COMPL, {"prompt": [[1], []]}, "prompt"),
        (COMPL, {"prompt": ["a", [1]]}, "prompt"),
        (COMPL, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMPL, {"prompt": "x", "logprobs": -1}, "logprobs"),
        (COMPL, {"prompt": "x", "logprobs": True}, "logprobs"),
        (COMPL, {"prompt": "x", "logprobs": "5"}, "logprobs"),
        (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": -2}, "top_logprobs"),
        (CHAT, {"messages": MSGS, "top_logprobs": 3}, "top_logprobs"),
        (CHAT, {"messages": MSGS, "logprobs": 1}, "logprobs"),
        (COMPL, {"prompt": "x", "echo": "yes"}, "echo"),
        (COMPL, {"prompt": "x", "echo": False, "max_tokens": 0}, "max_tokens"),
        (COMPL, {"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens"),
        (COMPL, {"prompt": "x", "best_of": 3}, "best_of"),
        (COMPL, {"prompt": "x", "suffix": "y"}, "suffix"),
        (COMPL, {"prompt": []}, "prompt"),
        (COMPL, {"prompt": ""}, "prompt"),
        (COMPL, {"prompt": [1, 99999]}, "prompt"),
        (COMPL, {"prompt": "x", "temperature": -1}, "temperature"),
        (COMPL, {"prompt": "x", "top_p": 0}, "top_p"),
        (COMPL, {"prompt": "x", "stop": [""]}, "stop"),
        (COMPL, {"prompt": "x", "seed": 2**64}, "seed"),
        (CHAT, {"messages": []}, "messages"),
        (
            CHAT,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_request_fields(client, path, body, param):
    err = assert_openai_error(client.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b"null", b'"text"'])
def test_bad_json_bodies(client, raw):
    r = client.post(COMPL, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_context_limit(client):
    limit = 508  # 127 usable blocks x 4 tokens (the tiny engine's max_model_len)
    err = assert_openai_error(client.post(COMPL, json={"prompt": "x" * (limit + 5)}), 400, "prompt")
    assert "maximum context length is 508" in err["message"]
    err = assert_openai_error(
        client.post(COMPL, json={"prompt": "x" * 10, "max_tokens": limit}), 400, "max_tokens"
    )
    assert "maximum context length" in err["message"]
    r = client.post(COMPL, json={"prompt": "x" * 10, "max_tokens": limit - 10})
    assert r.status_code == 200


def test_chat_without_template(served, monkeypatch):
    aeng, client = served
    monkeypatch.setattr(aeng.engine.tokenizer, "_chat_template", None)
    err = assert_openai_error(client.post(CHAT, json={"messages": MSGS}), 400)
    assert "chat template" in err["message"]


def test_unknown_model_is_404(client):
    for path, body in [(COMPL, {"prompt": "x"}), (CHAT, {"messages": MSGS})]:
        err = assert_openai_error(client.post(path, json={**body, "model": "gpt-4"}), 404, "model")
        assert err["code"] == "model_not_found"


def test_unknown_route_and_method(client):
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get(COMPL), 405)


def test_unexpected_exception_is_500(served, monkeypatch):
    aeng, client = served

    def boom(*_a, **_k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(aeng.engine, "tokenize", boom)
    err = assert_openai_error(client.post(COMPL, json={"prompt": "x"}), 500)
    assert err["message"] == "internal server error"  # the details stay in the server's log


def test_engine_step_failure(served, monkeypatch):
    aeng, client = served

    def failing_step():
        raise RuntimeError("step exploded")

    monkeypatch.setattr(aeng.engine, "step", failing_step)
    err = assert_openai_error(client.post(COMPL, json={"prompt": "x"}), 500)
    assert "step exploded" in err["message"]
    with client.stream("POST", CHAT, json={"messages": MSGS, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "step exploded" in events[-1]["error"]["message"]
    assert "[DONE]" not in events
    assert not aeng.engine.has_unfinished_requests()


def test_dead_engine(served):
    aeng, client = served
    aeng.shutdown()
    assert client.get("/health").status_code == 503
    err = assert_openai_error(client.post(COMPL, json={"prompt": "x"}), 503)
    assert err["type"] == "engine_dead_error"


def test_engine_dying_mid_request_does_not_hang(served, monkeypatch):
    aeng, client = served
    aeng.engine.step = lambda: aeng._stop.set() or []  # the thread exits without answering
    monkeypatch.setattr(aeng.engine.__class__, "has_unfinished_requests", lambda self: True)
    client.app.state.server.client.poll_interval = 0.05
    err = assert_openai_error(client.post(COMPL, json={"prompt": "x"}), 503)
    assert "engine stopped" in err["message"]


def test_bearer_token(make_app):
    _, app = make_app(api_key="s3cret")
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        err = assert_openai_error(c.get("/v1/models"), 401)
        assert err["type"] == "authentication_error"
        assert_openai_error(c.get("/metrics"), 401)
        bad = {"Authorization": "Bearer wrong"}
        assert_openai_error(c.post(COMPL, json={"prompt": "x"}, headers=bad), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=good).status_code == 200
        r = c.post(COMPL, json={"prompt": "x", "max_tokens": 1}, headers=good)
        assert r.status_code == 200

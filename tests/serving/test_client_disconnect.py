"""A client that goes away aborts its request and frees its KV blocks (real HTTP server)."""

from __future__ import annotations

import time

import httpx
import pytest

MAX_TOKENS = 400


def _slow(aeng, delay: float = 0.01) -> None:
    """~100 tokens/s, so that the request is surely still running when the client leaves."""
    step = aeng.engine.step

    def slow_step():
        time.sleep(delay)
        return step()

    aeng.engine.step = slow_step


def _assert_freed(aeng, timeout: float = 5.0, sequences: int = 1) -> None:
    eng = aeng.engine
    deadline = time.monotonic() + timeout
    while eng.has_unfinished_requests() or eng.stats().kv_usage > 0:
        assert time.monotonic() < deadline, "request not aborted after the client left"
        time.sleep(0.02)
    assert eng.generation_tokens < sequences * MAX_TOKENS / 2  # aborted, not run to completion


def _long_request(stream: bool, **extra) -> dict:
    return {
        "prompt": "Tell me a long story",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }


WIDE = {"prompt": ["Tell me a long story", "And another"], "n": 3}  # 2 requests, 6 sequences


@pytest.mark.parametrize("extra", [{}, WIDE], ids=["one", "prompts-x-n"])
def test_streaming_disconnect_aborts(live_server, extra):
    aeng, url = live_server()
    _slow(aeng)
    with httpx.Client(base_url=url, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json=_long_request(True, **extra)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6), strict=False) if line]
            assert got and got[0].startswith("data: ")
            assert aeng.engine.has_unfinished_requests()
        # leaving the block closes the connection mid-stream
        _assert_freed(aeng)
        metrics = c.get("/metrics").text
    aborted = 2.0 if extra else 1.0  # one per prompt
    assert f'kvpool_request_success_total{{finish_reason="abort"}} {aborted}' in metrics


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "wide"])
def test_non_streaming_disconnect_aborts(live_server, path):
    aeng, url = live_server()
    _slow(aeng)
    body = _long_request(False, **(WIDE if path == "wide" else {}))
    path = "/v1/completions" if path == "wide" else path
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    with httpx.Client(base_url=url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post(path, json=body)
    _assert_freed(aeng, sequences=6 if body.get("n") else 1)
    # the server keeps serving
    with httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/v1/completions", json={"prompt": "again", "max_tokens": 2})
        assert r.status_code == 200, r.text

"""Hostile HTTP clients against the conductor of a real cluster (127.0.0.1 only, bounded in
count and time): every one gets a clear 4xx with a JSON body, or is disconnected, and the
cluster keeps serving real completions."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import socket
import time

import httpx
import pytest
from conftest import HEADER_TIMEOUT, Cluster, closed_within, http_status

pytestmark = pytest.mark.slow

COMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
LEAKS = ("127.0.0.1:", "Traceback", 'File "/')  # what an error body must never carry


def post(c: Cluster, path: str, content: bytes | str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{c.url}{path}", content=content, timeout=timeout,
                      headers={**c.headers, "Content-Type": "application/json"})  # fmt: skip


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["type"]
    for word in words:
        assert word in err["message"], err["message"]
    assert not any(leak in r.text for leak in LEAKS), r.text
    return err


def test_only_clients_with_the_key_get_in(alive):
    if alive.token is None:  # open: loopback only, and nobody is asked for a key
        assert httpx.get(f"{alive.url}/v1/models", timeout=10).status_code == 200
        assert alive.complete().status_code == 200
        return
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": alive.token},
                    {"Authorization": f"Bearer {alive.token}x"}]:  # fmt: skip
        for method, path in [("POST", COMPL), ("GET", "/v1/models"), ("GET", "/cluster"),
                             ("GET", "/metrics")]:  # fmt: skip
            r = httpx.request(method, f"{alive.url}{path}", headers=headers, timeout=10,
                              json={"prompt": "x"} if method == "POST" else None)  # fmt: skip
            assert_error(r, 401, "API key")
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{alive.url}/health", timeout=10).status_code == 200  # probes need no key
    # the workers' own APIs refuse strangers too (the conductor relays with a derived key)
    for w in alive.workers():
        r = httpx.post(f"http://{w['address']}{COMPL}", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 401


DEEP = "[" * 100_000 + "]" * 100_000
BAD_BODIES = [
    ("not json", COMPL, "{", 400, "invalid JSON"),
    ("not an object", COMPL, "[1, 2]", 400, ""),
    ("deep nesting", COMPL, DEEP, 400, ""),
    ("deep nesting in a field", COMPL, '{"prompt": ' + DEEP + "}", 400, "recursion limit"),
    ("invalid utf-8", COMPL, b'{"prompt": "\xff\xfe"}', 400, ""),
    ("wrong type", COMPL, '{"prompt": 5}', 400, "prompt"),
    ("string number", COMPL, '{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    ("huge max_tokens", COMPL, '{"prompt": "x", "max_tokens": 1000000000000}', 400,
     "maximum context length"),
    ("huger max_tokens", COMPL, '{"prompt": "x", "max_tokens": ' + "9" * 400 + "}", 400, ""),
    ("negative max_tokens", COMPL, '{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("NaN", COMPL, '{"prompt": "x", "temperature": NaN}', 400, ""),
    ("infinite top_p", COMPL, '{"prompt": "x", "top_p": 1e999}', 400, ""),
    ("n", COMPL, '{"prompt": "x", "n": 1000}', 400, "n must be in [1, 16]"),
    ("huge n", COMPL, '{"prompt": "x", "n": ' + "9" * 400 + "}", 400, ""),
    ("negative n", COMPL, '{"prompt": "x", "n": -3}', 400, "n must"),
    ("zero n", CHAT, '{"messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n must"),
    ("string n", COMPL, '{"prompt": "x", "n": "3"}', 400, "n"),
    ("float n", COMPL, '{"prompt": "x", "n": 2.5}', 400, "n"),
    ("bool n", COMPL, '{"prompt": "x", "n": true}', 400, "n"),
    ("huge logprobs", COMPL, '{"prompt": "x", "logprobs": 1000000000}', 400, "logprobs"),
    ("negative logprobs", COMPL, '{"prompt": "x", "logprobs": -1}', 400, "logprobs"),
    ("bool logprobs", COMPL, '{"prompt": "x", "logprobs": true}', 400, "logprobs"),
    ("string logprobs", COMPL, '{"prompt": "x", "logprobs": "5"}', 400, "logprobs"),
    ("huge top_logprobs", CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                            "logprobs": True, "top_logprobs": 10**12}), 400,
     "top_logprobs"),
    ("negative top_logprobs", CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                "logprobs": True, "top_logprobs": -1}), 400,
     "top_logprobs"),
    ("top_logprobs alone", CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                             "top_logprobs": 3}), 400, "logprobs"),
    ("int chat logprobs", CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                            "logprobs": 5}), 400, "logprobs"),
    ("string echo", COMPL, '{"prompt": "x", "echo": "yes"}', 400, "echo"),
    ("max_tokens 0 without echo", COMPL, '{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("best_of", COMPL, '{"prompt": "x", "best_of": 5}', 400, "best_of"),
    ("prompts x n", COMPL, json.dumps({"prompt": ["x"] * 100, "n": 16}), 400, "choices"),
    ("many stops", COMPL, json.dumps({"prompt": "x", "stop": ["s"] * 10_000}), 400, "stop"),
    ("long stop", COMPL, json.dumps({"prompt": "x", "stop": "s" * 100_000}), 400, "stop"),
    ("empty prompt", COMPL, '{"prompt": ""}', 400, "empty"),
    ("empty token list", COMPL, '{"prompt": []}', 400, "empty"),
    ("unknown token ids", COMPL, '{"prompt": [1, 999999999]}', 400, "token ids"),
    ("negative token ids", COMPL, '{"prompt": [1, -5]}', 400, "token ids"),
    ("many prompts", COMPL, json.dumps({"prompt": ["a"] * 10_000}), 400, "prompt"),
    ("many id prompts", COMPL, json.dumps({"prompt": [[1]] * 10_000}), 400, "prompt"),
    ("an empty prompt among them", COMPL, '{"prompt": ["a", ""]}', 400, "empty"),
    ("mixed prompts", COMPL, '{"prompt": ["a", [1]]}', 400, "prompt"),
    ("bad ids in a second prompt", COMPL, '{"prompt": [[1], [1, 999999999]]}', 400,
     "token ids"),
    ("a second prompt too long", COMPL, json.dumps({"prompt": [[1], list(range(1, 5000))]}),
     400, "maximum context length"),
    ("unknown model", COMPL, '{"prompt": "x", "model": "gpt-9"}', 404, "does not exist"),
    ("no messages", CHAT, '{"messages": []}', 400, "messages"),
    ("many messages", CHAT, json.dumps({"messages": [{"role": "u", "content": "x"}] * 5000}),
     400, "messages"),
    ("image part", CHAT, json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]}]}), 400,
     "not supported"),
]  # fmt: skip


@pytest.mark.parametrize("what, path, body, status, word", BAD_BODIES,
                         ids=[b[0] for b in BAD_BODIES])  # fmt: skip
def test_bad_requests_get_clear_errors(cluster, what, path, body, status, word):
    assert_error(post(cluster, path, body), status, *([word] if word else []))


def test_wide_requests_are_served(alive):
    """Several prompts, n, echo and logprobs at once: every choice, in order, with usage."""
    body = {"prompt": ["The capital of France is", "Once upon a"], "n": 3, "echo": True,
            "logprobs": 20, "max_tokens": 3, "temperature": 0.7, "seed": 1}  # fmt: skip
    r = post(alive, COMPL, json.dumps(body))
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert all(c["logprobs"]["token_logprobs"][0] is None for c in choices)
    assert all(len(top) <= 21 for c in choices for top in c["logprobs"]["top_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 18


HOSTILE_DECODES = [
    {"params": {"n": 10**6}},
    {"params": {"n": -1}},
    {"params": {"logprobs": 10**6}},
    {"params": {"prompt_logprobs": -5}},
    {"params": {"logprobs": "all"}},
    {"params": {"seed": 2**80}},
    {"more_token_ids": [[1]] * 1000},
    {"more_token_ids": [[1, 10**9]]},
    {"more_token_ids": [list(range(1, 5000))]},
    {"more_token_ids": "abc"},
    {"echo": "yes"},
    {"prompt_only": True},
    {"kind": "chat", "more_token_ids": [[1]]},
]


@pytest.mark.parametrize("change", HOSTILE_DECODES, ids=[str(d)[:40] for d in HOSTILE_DECODES])
def test_hostile_decode_requests_are_400(cluster, change):
    """The workers' typed route (with the cluster's internal key, where there is one) checks
    the new fields as strictly as the public API."""
    body = {"request_id": "sec-d", "kind": "completion", "token_ids": [1, 2, 3],
            "params": {"max_tokens": 2}}  # fmt: skip
    for key, value in change.items():
        body[key] = {**body[key], **value} if key == "params" else value
    worker = cluster.workers("decode")[0]["address"]
    r = httpx.post(f"http://{worker}/internal/generate", json=body, headers=cluster.internal,
                   timeout=30)  # fmt: skip
    assert_error(r, 400)


def test_prompts_that_can_never_fit_are_400_not_429(alive):
    limit = 4096  # --max-model-len
    t0 = time.monotonic()
    r = post(alive, COMPL, json.dumps({"prompt": list(range(1, 100_001)), "max_tokens": 4}))
    assert_error(r, 400, "maximum context length is 4096")
    r = post(alive, COMPL, json.dumps({"prompt": "word " * 400_000}))  # 2 M characters
    assert_error(r, 400, f"maximum context length of {limit}")
    r = post(alive, CHAT, json.dumps({"messages": [{"role": "user", "content": "hi " * 5000}]}))
    assert_error(r, 400, "maximum context length")
    assert time.monotonic() - t0 < 20  # rejected up front, not after computing
    # the refusals were the clients' fault: no worker was marked failed
    assert all(w["alive"] for w in alive.workers())


def test_bodies_over_the_limit_are_413(alive):
    r = post(alive, COMPL, b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
    assert_error(r, 413, "over")
    with socket.create_connection(("127.0.0.1", alive.port), timeout=10) as s:  # 50 MiB declared
        auth = f"Authorization: Bearer {alive.token}\r\n" if alive.token else ""
        s.sendall(f"POST {COMPL} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                  f"Content-Length: {50 << 20}\r\n\r\n".encode() + b"{" * 1000)  # fmt: skip
        assert http_status(s) == 413  # answered without reading 50 MiB
    with socket.create_connection(("127.0.0.1", alive.port), timeout=10) as s:  # chunked
        auth = f"Authorization: Bearer {alive.token}\r\n" if alive.token else ""
        s.sendall(f"POST {COMPL} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n".encode())  # fmt: skip
        chunk = b"x" * (1 << 20)
        try:
            for _ in range(8):
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except OSError:
            pass  # it may hang up on us once over the limit
        assert http_status(s) == 413


def test_slow_header_connections_are_closed(alive):
    """200 connections that trickle their headers are all closed within the header timeout,
    while the service keeps answering."""
    conns = []
    t0 = time.monotonic()
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", alive.port), timeout=10)
        s.sendall(f"POST {COMPL} HTTP/1.1\r\nHost: x\r\n".encode())  # never finishes
        conns.append(s)
    assert httpx.get(f"{alive.url}/health", timeout=10).status_code == 200
    with cf.ThreadPoolExecutor(50) as pool:
        closed = list(pool.map(lambda s: closed_within(s, HEADER_TIMEOUT + 3), conns))
    took = time.monotonic() - t0
    for s in conns:
        s.close()
    assert all(closed), f"{closed.count(False)} of 200 slow connections still open"
    assert took < HEADER_TIMEOUT + 1.5, f"closed after {took:.1f} s"  # the timeout, + slack


def _disconnect_early(c: Cluster, i: int) -> None:
    prompt = f"Count to a hundred, attempt {i}:"
    wide = {"prompt": [prompt, "And backwards:"], "n": 3, "logprobs": 2, "echo": True}
    body = json.dumps({"prompt": prompt, "max_tokens": 48, "stream": i % 2 == 0,
                       "temperature": 0, **(wide if i % 5 == 0 else {})}).encode()  # fmt: skip
    auth = f"Authorization: Bearer {c.token}\r\n" if c.token else ""
    with socket.create_connection(("127.0.0.1", c.port), timeout=10) as s:
        s.sendall(f"POST {COMPL} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        time.sleep(random.Random(i).uniform(0.0, 0.4))  # before or after the first byte


def test_early_disconnects_leave_nothing_in_flight(alive):
    with cf.ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda i: _disconnect_early(alive, i), range(100)))

    def busy() -> list:
        """Whatever is still at work: requests being admitted, in flight, running."""
        out = [("conductor", g, n) for g in ("arriving", "inflight") if (n := alive.inflight(g))]
        return out + [(w["id"], w["load"]) for w in alive.workers()
                      if w["load"]["inflight"] or w["load"]["running"]]  # fmt: skip

    # the clients are gone, but the last requests may still be on their way in (read from the
    # sockets, tokenized, handed to a worker that then sees the disconnect): quiet must hold
    # for three polls in a row, within a minute
    deadline, quiet = time.monotonic() + 60, 0
    while quiet < 3 and time.monotonic() < deadline:
        quiet = 0 if busy() else quiet + 1
        time.sleep(0.5)
    assert quiet == 3, f"still busy 60 s after the last client left: {busy()}"


def test_a_non_streaming_disconnect_aborts_the_decode(alive):
    body = json.dumps({"prompt": "Tell a very long story.", "max_tokens": 1500,
                       "ignore_eos": True, "temperature": 0}).encode()  # fmt: skip
    auth = f"Authorization: Bearer {alive.token}\r\n" if alive.token else ""
    with socket.create_connection(("127.0.0.1", alive.port), timeout=10) as s:
        s.sendall(f"POST {COMPL} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        deadline = time.monotonic() + 30
        while not any(w["load"]["running"] for w in alive.workers("decode")):
            assert time.monotonic() < deadline, "the request never reached the decode worker"
            time.sleep(0.1)
    t0 = time.monotonic()  # disconnected: 1,500 tokens would take minutes here
    while any(w["load"]["running"] for w in alive.workers("decode")):
        assert time.monotonic() - t0 < 10, "the decode goes on for a client that left"
        time.sleep(0.2)
    assert alive.inflight() == 0

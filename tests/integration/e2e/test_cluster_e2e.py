"""`kvpool serve` as the disaggregated cluster (pool, 2 prefill + 1 decode workers, conductor)
with the real model, driven by the official OpenAI client. Destructive steps run last."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from support.procs import serve

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant who answers geography questions in one short sentence. "


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cluster; when it stops: every process it started is gone, and no shared memory of
    theirs is left in /dev/shm."""
    log = tmp_path_factory.mktemp("cluster") / "serve.log"
    running = serve(log, "--prefill", "2", "--decode", "1", "--policy", "round_robin",
                    "--kv-cache-memory", "256MiB", "--store-memory", "512MiB",
                    "--max-inflight", "4", "--slo-ttft", "0", "--slo-tbt", "0",
                    "--decode-prefill-tokens", "0", "--decode-prefill-gain", "0")  # fmt: skip
    proc, url = next(running)
    pids = [p["pid"] for p in cluster_doc(url)["processes"].values()]
    assert len(pids) == 5
    yield proc, url
    with contextlib.suppress(StopIteration):
        next(running)  # SIGTERM to `kvpool serve`, checked to exit 0
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "orphan processes"
    leaked = [f for f in os.listdir("/dev/shm")
              if any(f.startswith(f"kvpool-{pid}-") for pid in pids)]  # fmt: skip
    assert not leaked, leaked
    ledgers = [f for f in os.listdir("/dev/shm") if f.startswith(f"kvpool-cores-{proc.pid}-")]
    assert not ledgers, ledgers  # the workers' core ledger went with them


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster[1]}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of one in-process engine (the single-engine baseline)."""
    from kvpool.engine.llm import LLM

    return LLM(kv_cache_memory_bytes="128MiB")


def fetch_decisions(url: str) -> dict[str, list[str]]:
    """Each prefill worker's load-or-recompute decisions (its /metrics), to explain a test."""
    out = {}
    for w in cluster_doc(url)["workers"]:
        text = httpx.get(f"http://{w['address']}/metrics", timeout=10).text
        out[w["id"]] = [line for line in text.splitlines()
                        if line.startswith("kvpool_kv_fetch")]  # fmt: skip
    return out


def cluster_doc(url: str) -> dict:
    return httpx.get(f"{url}/cluster", timeout=10).json()


def counters(url: str) -> dict[str, dict]:
    return {w["id"]: w["counters"] for w in cluster_doc(url)["workers"]}


def counters_with(url: str, before: dict[str, dict], prompt_tokens: int,
                  timeout: float = 10.0) -> dict[str, dict]:  # fmt: skip
    """The counters once the prefill workers' reports count ``prompt_tokens`` more prompt
    tokens than ``before`` (or after ``timeout``): ``/cluster`` shows what the conductor's last
    status poll of each worker read, and a short answer can come back before the next one."""
    deadline = time.monotonic() + timeout
    while True:
        now = counters(url)
        seen = sum(now[w]["prompt_tokens"] - before[w]["prompt_tokens"]
                   for w in ("prefill-1", "prefill-2"))  # fmt: skip
        if seen >= prompt_tokens or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def saved_settled(url: str, before: dict[str, dict], timeout: float = 30.0) -> None:
    """Wait until the prefill workers saved more than ``before`` and stopped (two looks 0.5 s
    apart, as the conductor's status polls report them)."""

    def saved() -> float:
        now = counters(url)
        return sum(now[w]["pool_saved_bytes"] - before[w]["pool_saved_bytes"]
                   for w in ("prefill-1", "prefill-2"))  # fmt: skip

    deadline, last = time.monotonic() + timeout, -1.0
    while time.monotonic() < deadline:
        now = saved()
        if now > 0 and now == last:
            return
        last = now
        time.sleep(0.5)
    raise AssertionError(f"the prefill workers' saves did not settle in {timeout} s ({last} B)")


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=24, **kw)  # fmt: skip


def single_engine_chat(llm, messages, max_tokens=24) -> str:
    from kvpool import SamplingParams

    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    return out.outputs[0].text


def first_tokens_from_prefill(client) -> float:
    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics", timeout=10).text
    line = [x for x in text.splitlines() if x.startswith("kvpool_first_tokens_from_prefill_total")]
    return float(line[0].split()[-1])


def test_cluster_document_and_health(cluster):
    doc = cluster_doc(cluster[1])
    roles = sorted(w["role"] for w in doc["workers"])
    assert roles == ["decode", "prefill", "prefill"] and all(w["alive"] for w in doc["workers"])
    assert doc["store"]["up"] is True and doc["store"]["nodes"] == 1
    assert {"store-master", "store-node", "prefill-1", "prefill-2", "decode-1"} <= set(
        doc["processes"]
    )
    assert httpx.get(f"{cluster[1]}/health").json()["status"] == "ok"


def test_prefix_computed_on_one_prefill_worker_is_loaded_by_the_other(cluster, client):
    # first of the tests that send prompts, so neither prefill worker has measured a load yet
    # and the fetch policy loads to measure (later its decision depends on what it measured)
    url = cluster[1]
    before = counters(url)
    shared = "Background: " + "the river flows north through the old valley. " * 40
    outs = []
    for i, q in enumerate(["Where does the river flow?", "What is old?"]):  # round robin
        outs.append(client.completions.create(model=MODEL, prompt=shared + q, max_tokens=4,
                                              temperature=0))  # fmt: skip
        if i == 0:  # the answer does not wait for the prefill worker's saves: the test does
            saved_settled(url, before)
    after = counters_with(url, before, sum(o.usage.prompt_tokens for o in outs))
    pool_hits = {w: after[w]["prefix_hits_pool"] - before[w]["prefix_hits_pool"]
                 for w in ("prefill-1", "prefill-2")}  # fmt: skip
    if max(pool_hits.values()) < 64:  # in full (an assertion's message is cut short)
        print("prefill counters:", {w: after[w] for w in ("prefill-1", "prefill-2")})
        print("fetch decisions:", fetch_decisions(url))
    assert max(pool_hits.values()) >= 64, pool_hits  # >= 4 blocks
    loaded = after["decode-1"]["pool_loaded_bytes"] - before["decode-1"]["pool_loaded_bytes"]
    assert loaded > 0
    # the decode worker read the prompts' KV straight from the prefill workers (their handles)
    direct = after["decode-1"]["direct_read_bytes"] - before["decode-1"]["direct_read_bytes"]
    assert direct > 0 and after["decode-1"]["direct_fallbacks"] == before["decode-1"][
        "direct_fallbacks"]  # fmt: skip
    metrics = httpx.get(f"{url}/metrics").text
    assert 'kvpool_prefix_cache_hits_total{source="pool"}' in metrics
    assert "kvpool_time_to_first_token_seconds_count" in metrics


def test_multi_turn_chat_reuses_the_prefix_and_matches_one_engine(cluster, client, reference):
    turn1 = [{"role": "system", "content": SYSTEM * 3},
             {"role": "user", "content": "What is the capital of France?"}]  # fmt: skip
    first = chat(client, turn1)
    answer = first.choices[0].message.content
    assert answer == single_engine_chat(reference, turn1)
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And the capital of Italy?"}]  # fmt: skip
    early = first_tokens_from_prefill(client)
    tails = counters(cluster[1])["decode-1"]
    stream = chat(client, turn2, stream=True, stream_options={"include_usage": True})
    text, usage, ids = "", None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == single_engine_chat(reference, turn2)
    assert usage.prompt_tokens_details.cached_tokens > 0  # turn 1's prefix was reused
    from kvpool import SamplingParams

    ref = reference.chat(turn2, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert usage.completion_tokens == len(ref.token_ids) and len(ids) == 1  # one stream
    # its first token came from the prefill worker, sent by the conductor
    assert first_tokens_from_prefill(client) == early + 1
    # and the decode worker read the prompt's partial last block from it too (when it has one:
    # then it computed only that first token, with the same answer as one engine)
    after = counters(cluster[1])["decode-1"]
    if usage.prompt_tokens % 16:
        assert after["direct_tail_reads"] == tails["direct_tail_reads"] + 1, after


def test_workers_step_on_the_cores_of_idle_ones(cluster, client):
    """Three workers on this host share its cores (engine/core_share.py): a prompt computed
    while the other workers idle runs on more threads than a worker's share."""
    from kvpool.engine.core_share import host_cores

    if host_cores() < 2:
        pytest.skip("one core: a worker's share is the whole host")
    _, url = cluster
    chat(client, [{"role": "user", "content": SYSTEM + "Which river flows through Vienna?"}])
    widened, threads = {}, {}
    for w in cluster_doc(url)["workers"]:
        for line in httpx.get(f"http://{w['address']}/metrics", timeout=10).text.splitlines():
            if line.startswith("kvpool_widened_steps_total"):
                widened[w["id"]] = float(line.split()[-1])
            if line.startswith("kvpool_engine_threads"):
                threads[w["id"]] = float(line.split()[-1])
    assert len(widened) == 3 and all(t >= 1 for t in threads.values()), (widened, threads)
    # the prefill that computed it ran alone, and so did the decode worker's steps after it
    assert widened["decode-1"] > 0 and sum(widened.values()) > widened["decode-1"], widened


def test_overload_gets_429_with_retry_after_and_no_unbounded_queue(cluster):
    url = cluster[1]
    body = {"model": MODEL, "prompt": "Count slowly: one, two, three,", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}  # fmt: skip

    def one(_):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        return r.status_code, r.headers.get("retry-after"), r.json()

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    codes = [c for c, _, _ in results]
    assert codes.count(429) >= 4 and codes.count(200) >= 4, codes  # --max-inflight 4
    assert set(codes) <= {200, 429}
    for code, retry, doc in results:
        if code == 429:
            assert retry is not None and int(retry) >= 1
            assert doc["error"]["type"] == "rate_limit_error"
    metrics = httpx.get(f"{url}/metrics").text
    assert 'kvpool_requests_rejected_total{reason="queue_full"}' in metrics
    time.sleep(0.5)
    assert all(w["load"]["inflight"] == 0 for w in cluster_doc(url)["workers"])


def test_service_survives_the_pool_stopping(cluster, client):
    url = cluster[1]
    procs = cluster_doc(url)["processes"]
    for name in ("store-node", "store-master"):
        os.kill(procs[name]["pid"], signal.SIGTERM)
    time.sleep(1.5)
    for q in ["Name a color.", "Name a fruit."]:
        out = client.completions.create(model=MODEL, prompt="Question: " + q, max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert out.usage.completion_tokens == 6
    assert cluster_doc(url)["store"]["up"] is False


def test_decode_worker_killed_mid_stream(cluster, client):
    url = cluster[1]
    pid = cluster_doc(url)["processes"]["decode-1"]["pid"]
    stream = client.completions.create(model=MODEL, prompt="Tell a long story about a ship.",
                                       max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    got = 0
    with pytest.raises(openai.APIError):
        for _chunk in stream:
            got += 1
            if got == 3:
                os.kill(pid, signal.SIGKILL)
    assert got >= 3
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # removed from routing within seconds
        if not next(w for w in cluster_doc(url)["workers"] if w["id"] == "decode-1")["alive"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the dead decode worker is still listed alive")
    out = client.completions.create(model=MODEL, prompt="After the storm,", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage.completion_tokens == 8  # served by a prefill worker doing both

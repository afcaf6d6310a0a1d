"""`kvpool serve` (1 prefill + 1 decode worker) under sustained load of long, distinct prompts:
the conductor lends some whole prompts to the decode worker (`--decode-prefill-gain`), and
every answer equals one engine's greedy answer."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest
from support.procs import serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["rivers", "copper mines", "lighthouses", "orchards", "glaciers", "falcons",
          "harbors", "comets", "meadows", "lanterns"]  # fmt: skip


def prompt(i: int) -> str:
    """About 300 tokens, distinct from its first block on (no prefix shared with the others)."""
    topic = TOPICS[i % len(TOPICS)]
    body = " ".join(f"Fact {k} about {topic}: {topic} change slowly over the years, and people "
                    f"who study {topic} write long notes about them." for k in range(12))  # fmt: skip
    return f"Report number {i}, on {topic}. {body} In one sentence, {topic} are"


def lent(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = [x for x in text.splitlines()
            if x.startswith('kvpool_prompts_on_decode_total{reason="lent"}')]  # fmt: skip
    return float(line[0].split()[-1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("lending") / "serve.log"
    yield from serve(log, "--kv-cache-memory", "256MiB", "--store-memory", "256MiB",
                     "--slo-ttft", "0", "--slo-tbt", "0")  # fmt: skip


def test_sustained_load_lends_prompts_to_the_decode_worker_with_one_engines_answers(cluster):
    from kvpool import SamplingParams
    from kvpool.engine.llm import LLM

    url = cluster[1]
    prompts = [prompt(i) for i in range(20)]
    before = lent(url)

    def complete(text: str) -> str:
        r = httpx.post(f"{url}/v1/completions", timeout=300,
                       json={"model": MODEL, "prompt": text, "max_tokens": 6, "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def stream(k: int) -> list[str]:  # one client sending its prompts one after the other
        return [complete(t) for t in prompts[k::4]]

    with cf.ThreadPoolExecutor(4) as pool:  # four such clients: the prefill queue stays full
        per_stream = list(pool.map(stream, range(4)))
    answers = [per_stream[i % 4][i // 4] for i in range(len(prompts))]
    got = lent(url) - before
    # the first requests go to the prefill worker (a burst is not lent); once its queue has
    # stayed full for seconds, some go to the decode worker, never all
    assert 1 <= got < len(prompts), got
    llm = LLM(kv_cache_memory_bytes="128MiB")
    ref = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert answers == [o.outputs[0].text for o in ref]

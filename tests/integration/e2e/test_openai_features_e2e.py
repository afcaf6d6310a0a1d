"""logprobs, top_logprobs, echo, n, several prompts and include_usage through the official
OpenAI client, against `kvpool serve --single` and against the disaggregated cluster (conductor,
one prefill and one decode worker, the pool), with the real model; numbers are checked against
an in-process engine on the same weights."""

from __future__ import annotations

import httpx
import pytest
from support.procs import serve

from kvpool import LLM, SamplingParams

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris. The capital of Germany is"
TOL = 2e-3  # another process, another batch: float32 rounding apart
CLUSTER = ("--prefill", "1", "--decode", "1", "--kv-cache-memory", "256MiB", "--store-memory",
           "256MiB", "--slo-ttft", "0", "--slo-tbt", "0", "--decode-prefill-tokens", "0",
           "--decode-prefill-gain", "0")  # fmt: skip


@pytest.fixture(scope="module", params=["single", "cluster"])
def server(request, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"openai-{request.param}") / "serve.log"
    flags = ("--single", "--kv-cache-memory", "256MiB") if request.param == "single" else CLUSTER
    for _proc, url in serve(log, *flags):
        yield request.param, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference():
    """An engine of this process on the same weights (the servers' default ones)."""
    return LLM(kv_cache_memory_bytes="128MiB")


def prefill_prompt_tokens(server) -> int:
    doc = httpx.get(f"{server[1]}/cluster", timeout=10).json()
    return sum(w["counters"]["prompt_tokens"] for w in doc["workers"] if w["role"] == "prefill")


def test_completion_logprobs_streamed_and_not(client, reference):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    ids = reference.get_tokenizer().encode(PROMPT)
    ref = reference.generate([ids], SamplingParams(temperature=0, max_tokens=8, logprobs=3))
    ref = ref[0].outputs[0]
    assert r.choices[0].text == ref.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref.token_ids)
    for tok, value, top, d, t in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                     ref.logprobs, ref.token_ids, strict=True):  # fmt: skip
        assert value == pytest.approx(d[t].logprob, abs=TOL)
        assert 3 <= len(top) <= 4 and top[tok] == value
        assert max(top.values()) == value  # greedy: the most likely token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert streamed == pytest.approx(lp.token_logprobs, abs=TOL)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_chat_logprobs_streamed_and_not(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}],
          "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert 0 < len(content) <= 10
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode() == c.token
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]  # fmt: skip
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=TOL)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompts_logprobs(server, client, reference, max_tokens):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 0 or 1. In the cluster the
    decode worker computes the prompt itself (the prefill worker sees nothing of it)."""
    ids = reference.get_tokenizer().encode(PROMPT)
    ref = reference.generate([ids], SamplingParams(temperature=0, max_tokens=1,
                                                   prompt_logprobs=1))[0].prompt_logprobs  # fmt: skip
    before = prefill_prompt_tokens(server) if server[0] == "cluster" else 0
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1,
                                  max_tokens=max_tokens, temperature=0)  # fmt: skip
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = lp.token_logprobs[1 : len(ids)]
    assert got == pytest.approx([ref[j][ids[j]].logprob for j in range(1, len(ids))], abs=TOL)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert r.choices[0].text == PROMPT and r.choices[0].finish_reason == "length"
    if server[0] == "cluster":
        assert prefill_prompt_tokens(server) == before


def test_n_sequences_are_the_seeded_requests_of_seed_plus_i(client):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0}
    r = client.completions.create(**kw, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(**kw, seed=7 + i).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == alone
    assert len(set(alone)) > 1
    assert r.usage.completion_tokens == sum(
        client.completions.create(**kw, seed=7 + i).usage.completion_tokens for i in range(3))  # fmt: skip


def test_two_prompts_with_n_and_logprobs(client):
    prompts = [PROMPT, "Once upon a time"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6,
                                  temperature=0, logprobs=1)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert r.choices[2 * p].text == r.choices[2 * p + 1].text == one.choices[0].text
        assert len(r.choices[2 * p].logprobs.tokens) == one.usage.completion_tokens
    assert r.usage.prompt_tokens == sum(
        client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens
        for p in prompts)  # fmt: skip


def test_streams_with_n_prompts_and_include_usage(client):
    kw = {"model": MODEL, "prompt": [PROMPT, "Once upon a time"], "n": 2, "max_tokens": 8,
          "temperature": 0.8, "seed": 3}  # fmt: skip
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    texts, finishes = [""] * 4, [0] * 4
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        finishes[choice.index] += choice.finish_reason is not None
    assert texts == [c.text for c in full.choices] and finishes == [1] * 4
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens)  # fmt: skip
    ckw = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "n": 3,
           "max_tokens": 6, "temperature": 0.8, "seed": 3}  # fmt: skip
    chat = list(client.chat.completions.create(**ckw, stream=True,
                                               stream_options={"include_usage": True}))  # fmt: skip
    roles = {c.choices[0].index for c in chat if c.choices and c.choices[0].delta.role}
    assert roles == {0, 1, 2}
    full_chat = client.chat.completions.create(**ckw)
    assert chat[-1].usage.completion_tokens == full_chat.usage.completion_tokens
    texts = [""] * 3
    for c in chat[:-1]:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts == [c.message.content for c in full_chat.choices]


def test_limits_are_400s(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", n=17, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", logprobs=21, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=21, max_tokens=1)  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)  # without echo

"""logprobs, top_logprobs, echo, n > 1, several prompts and include_usage through the OpenAI
endpoints over the tiny model, checked against an offline engine on the same weights."""

from __future__ import annotations

import pytest
from serving_helpers import assert_openai_error, sse_events

from kvpool.engine.sampling import SamplingParams

COMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
IDS = list(range(40, 70))  # 30 prompt tokens (byte-level: the text "()*+,-./0123...")
TEXT = "The fox jumps over the dog."
HOT = {"temperature": 50.0, "ignore_eos": True}  # varied text on the tiny model


@pytest.fixture
def offline(tiny_engine_factory):
    """``run(prompt, **params) -> RequestOutput`` of an engine of its own (same weights)."""
    eng = tiny_engine_factory(num_threads=1)

    def run(prompt, **params):
        eng.add_request("r", prompt, SamplingParams(**params))
        last = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                last = out
        return last

    return run


def post(client, path, **body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def events(client, path, **body):
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    evs = sse_events(r.text.splitlines())
    assert evs[-1] == "[DONE]"
    return evs[:-1]


def close(a, b):
    return a == pytest.approx(b, rel=1e-6, abs=1e-5)


def prompt_text(client, ids=IDS):
    return client.app.state.server.client.engine.tokenizer.decode(ids)


def same_counts(a: dict, b: dict) -> bool:
    """Equal usage but for cached tokens (the second of two equal requests hits the cache)."""
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return all(a[k] == b[k] for k in keys)


def same_chat_logprobs(a: list, b: list) -> bool:
    """Equal up to rounding: a prefix-cache hit attends through another kernel, and the block
    kernel's 16-bit activations can turn a last-bit difference of its input into one
    quantization step (~3e-5 of a block's largest value): 1e-4 relative on a logprob."""

    def flat(c):
        return [c["token"], c["bytes"], [(t["token"], t["bytes"]) for t in c["top_logprobs"]]]

    values = [x for c in a for x in [c["logprob"], *(t["logprob"] for t in c["top_logprobs"])]]
    others = [x for c in b for x in [c["logprob"], *(t["logprob"] for t in c["top_logprobs"])]]
    return [flat(c) for c in a] == [flat(c) for c in b] and values == pytest.approx(
        others, rel=1e-4, abs=1e-5)  # fmt: skip


def test_completion_logprobs_are_the_engines(client, offline):
    body = post(client, COMPL, prompt=IDS, max_tokens=6, temperature=0, logprobs=3,
                ignore_eos=True)  # fmt: skip
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    ref = offline(IDS, max_tokens=6, temperature=0, logprobs=3, ignore_eos=True).outputs[0]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ref.token_ids) == 6
    tok = client.app.state.server.client.engine.tokenizer
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    for i, (d, t) in enumerate(zip(ref.logprobs, ref.token_ids, strict=True)):
        value, top = lp["token_logprobs"][i], lp["top_logprobs"][i]
        assert close(value, d[t].logprob)
        assert top[lp["tokens"][i]] == value  # the token's own, with the 3 most likely
        assert len(top) in (3, 4)
        assert max(top.values()) == pytest.approx(max(x.logprob for x in d.values()))
    offsets = lp["text_offset"]
    assert offsets[0] == 0
    assert all(b - a == len(s) for a, b, s in zip(offsets, offsets[1:], lp["tokens"], strict=False))


def test_echo_with_logprobs_gives_the_prompts_logprobs(client, offline):
    ref = offline(IDS, max_tokens=1, temperature=0, prompt_logprobs=1).prompt_logprobs
    for max_tokens in (0, 1):  # lm-eval's loglikelihood requests
        body = post(client, COMPL, prompt=IDS, max_tokens=max_tokens, temperature=0,
                    logprobs=1, echo=True)  # fmt: skip
        (choice,) = body["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(IDS) + max_tokens
        assert choice["text"].startswith(prompt_text(client))
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(IDS)):
            assert close(lp["token_logprobs"][j], ref[j][IDS[j]].logprob)
            assert 1 <= len(lp["top_logprobs"][j]) <= 2
        assert body["usage"]["prompt_tokens"] == len(IDS)
        assert body["usage"]["completion_tokens"] == max_tokens
        if max_tokens == 0:
            assert choice["text"] == prompt_text(client)
            assert choice["finish_reason"] == "length"


def test_echo_without_logprobs_and_of_text(client):
    body = post(client, COMPL, prompt=TEXT, max_tokens=4, temperature=0, echo=True)
    plain = post(client, COMPL, prompt=TEXT, max_tokens=4, temperature=0)
    assert body["choices"][0]["text"] == TEXT + plain["choices"][0]["text"]
    assert body["choices"][0]["logprobs"] is None


def test_stream_logprobs_and_echo_add_up_to_the_full_answer(client):
    kw = {"prompt": IDS, "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True}
    full = post(client, COMPL, **kw)["choices"][0]
    evs = events(client, COMPL, **kw)
    text = "".join(e["choices"][0]["text"] for e in evs)
    assert text == full["text"]
    got = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for e in evs:
        lp = e["choices"][0]["logprobs"]
        for k in got:
            got[k] += lp[k] if lp else []
    assert got == full["logprobs"]
    assert evs[0]["choices"][0]["text"].startswith(prompt_text(client))
    assert [e["choices"][0]["finish_reason"] for e in evs].count("length") == 1


def test_chat_logprobs_shape_and_stream(client, offline):
    msgs = [{"role": "user", "content": "hi there"}]
    kw = {"messages": msgs, "max_tokens": 5, "temperature": 0, "logprobs": True,
          "top_logprobs": 2, "ignore_eos": True}  # fmt: skip
    body = post(client, CHAT, **kw)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for c in content:
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"}
        assert c["bytes"] and all(0 <= b < 256 for b in c["bytes"])
        assert len(c["top_logprobs"]) == 2
        tops = [t["logprob"] for t in c["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and c["logprob"] <= tops[0] + 1e-6
        assert c["logprob"] == tops[0] or c["token"] != c["top_logprobs"][0]["token"]
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"] or \
        any("\ufffd" in c["token"] for c in content)  # fmt: skip
    streamed = []
    for e in events(client, CHAT, **kw):
        lp = e["choices"][0]["logprobs"] if e["choices"] else None
        streamed += lp["content"] if lp else []
    assert same_chat_logprobs(streamed, content)
    plain = post(client, CHAT, **{**kw, "logprobs": False, "top_logprobs": None})
    assert plain["choices"][0]["logprobs"] is None
    zero = post(client, CHAT, **{**kw, "top_logprobs": 0})["choices"][0]["logprobs"]["content"]
    assert all(c["top_logprobs"] == [] for c in zero)
    assert [c["logprob"] for c in zero] == pytest.approx([c["logprob"] for c in content])


def test_bytes_of_a_partial_character_are_its_own(client):
    """A byte-level token that is half of 'é' decodes to U+FFFD; its bytes stay its own."""
    strings = client.app.state.server.strings
    tok = client.app.state.server.client.engine.tokenizer
    first, second = tok.encode("é")
    assert strings.text(first) == "\ufffd"
    assert strings.bytes(first) + strings.bytes(second) == list("é".encode())


def test_n_choices_are_the_seeded_requests_of_seed_plus_i(client):
    body = post(client, COMPL, prompt=TEXT, max_tokens=6, n=3, seed=7, **HOT)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    alone = [post(client, COMPL, prompt=TEXT, max_tokens=6, seed=7 + i, **HOT)["choices"][0]
             for i in range(3)]  # fmt: skip
    assert [c["text"] for c in body["choices"]] == [a["text"] for a in alone]
    assert len({c["text"] for c in body["choices"]}) > 1
    assert body["usage"]["completion_tokens"] == 18
    assert body["usage"]["prompt_tokens"] == len(TEXT)


def test_several_prompts_are_numbered_prompt_major(client):
    prompts = [TEXT, "Another prompt"]
    body = post(client, COMPL, prompt=prompts, max_tokens=5, n=2, seed=3, **HOT)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        one = post(client, COMPL, prompt=prompt, max_tokens=5, n=2, seed=3, **HOT)
        assert [c["text"] for c in body["choices"][2 * p : 2 * p + 2]] == [
            c["text"] for c in one["choices"]]  # fmt: skip
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert body["usage"]["completion_tokens"] == 20
    ids = post(client, COMPL, prompt=[IDS, IDS[:5]], max_tokens=2, temperature=0, echo=True,
               logprobs=0)  # fmt: skip
    assert [len(c["logprobs"]["tokens"]) for c in ids["choices"]] == [32, 7]


@pytest.mark.parametrize("path", [COMPL, CHAT])
def test_streams_interleave_choices_with_their_index_and_usage(client, path):
    if path == COMPL:
        kw = {"prompt": [TEXT, "Another one"], "n": 2}
    else:
        kw = {"messages": [{"role": "user", "content": TEXT}], "n": 3}
    kw.update(max_tokens=6, seed=5, stream_options={"include_usage": True}, **HOT)
    full = post(client, path, **{**kw, "stream_options": None})
    evs = events(client, path, **kw)
    usage = evs[-1]
    assert usage["choices"] == [] and same_counts(usage["usage"], full["usage"])
    choices = len(full["choices"])
    texts = [""] * choices
    finishes = [0] * choices
    roles = set()
    for e in evs[:-1]:
        assert e["usage"] is None
        (c,) = e["choices"]
        if path == COMPL:
            texts[c["index"]] += c["text"]
        else:
            texts[c["index"]] += c["delta"].get("content") or ""
            if "role" in c["delta"]:
                roles.add(c["index"])
        finishes[c["index"]] += c["finish_reason"] is not None
    assert finishes == [1] * choices
    key = "text" if path == COMPL else "message"
    want = [c[key] if path == COMPL else c[key]["content"] for c in full["choices"]]
    assert texts == want
    if path == CHAT:
        assert roles == set(range(choices))


def test_greedy_n_gives_equal_answers(client):
    body = post(client, COMPL, prompt=TEXT, max_tokens=4, n=4, temperature=0)
    assert len({c["text"] for c in body["choices"]}) == 1


def test_limits(client):
    assert_openai_error(client.post(COMPL, json={"prompt": "x", "n": 17}), 400, "n")
    assert_openai_error(client.post(COMPL, json={"prompt": "x", "logprobs": 21}), 400, "logprobs")
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}
    assert_openai_error(client.post(CHAT, json=body), 400, "top_logprobs")
    ok = post(client, COMPL, prompt=["x"] * 16, n=16, max_tokens=1)
    assert len(ok["choices"]) == 256
    assert client.app.state.server.client.engine.pool.usage() == 0


def test_internal_generate_several_prompts_echo_and_logprobs(client):
    """The conductor's typed path carries the other prompts, echo and the logprob counts."""
    public = post(client, COMPL, prompt=[IDS, IDS[:9]], max_tokens=3, temperature=0, echo=True,
                  logprobs=2, n=2)  # fmt: skip
    params = {"max_tokens": 3, "temperature": 0.0, "n": 2, "logprobs": 2, "prompt_logprobs": 2}
    body = {"request_id": "d", "kind": "completion", "token_ids": IDS, "params": params,
            "more_token_ids": [IDS[:9]], "echo": True}  # fmt: skip
    r = client.post("/internal/generate", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in public["choices"]]
    assert [c["logprobs"] for c in got["choices"]] == [c["logprobs"] for c in public["choices"]]
    assert got["usage"] == public["usage"]
    bad = {**body, "first_token": 5, "response_id": "x", "created": 1, "stream": True}
    assert client.post("/internal/generate", json=bad).status_code == 400


def test_streamed_echo_of_the_prompt_alone(client):
    kw = {"prompt": [IDS, IDS[:7]], "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2,
          "stream_options": {"include_usage": True}}  # fmt: skip
    full = post(client, COMPL, **{**kw, "stream_options": None})
    evs = events(client, COMPL, **kw)
    assert evs[-1]["usage"]["completion_tokens"] == 0
    chunks = [e["choices"][0] for e in evs[:-1]]
    assert sorted(c["index"] for c in chunks) == [0, 1, 2, 3]  # one chunk per choice
    by_index = {c["index"]: c for c in chunks}
    for c in full["choices"]:
        got = by_index[c["index"]]
        assert got["text"] == c["text"] == prompt_text(client, [IDS, IDS[:7]][c["index"] // 2])
        assert got["finish_reason"] == c["finish_reason"] == "length"
        assert got["logprobs"]["tokens"] == c["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"][0] is None

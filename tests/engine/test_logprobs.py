"""Logprobs of sampled and prompt tokens on the tiny model: exactly ``log_softmax`` of the logits
the runner produced, the same however the prompt is cut into chunks, never from the cache."""

import pytest
import torch
from support.engine import run_requests as run

from kvpool.engine import model_runner
from kvpool.engine.logprobs import PROMPT_LOGITS_ROWS, Logprob, logprob_dicts
from kvpool.engine.sampling import SamplingParams
from kvpool.model.kernels import kernels

PROMPT = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture
def spied(monkeypatch):
    """``spy(engine) -> list`` of every logits tensor the engine's model head returned."""

    def spy(eng):
        seen = []
        head = eng.model.logits

        def logits(hidden, prompt=False):
            out = head(hidden, prompt)
            seen.append(out.clone())
            return out

        monkeypatch.setattr(eng.model, "logits", logits)
        return seen

    return spy


def test_logprob_dicts_put_the_token_first_then_the_top_k():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    lp = torch.log_softmax(logits, dim=-1)
    rows = logprob_dicts(logits, [3, 0], [2, 0])
    assert list(rows[0]) == [3, 1, 2]
    assert rows[0][3] == Logprob(lp[0, 3].item(), 3)
    assert rows[0][1] == Logprob(lp[0, 1].item(), 1)
    assert rows[1] == {0: Logprob(lp[1, 0].item(), 1)}
    # the sampled token among the top k is listed once: k + 1 entries at most
    assert list(logprob_dicts(logits[:1], [1], [2])[0]) == [1, 2]


def test_sample_logprobs_are_log_softmax_of_the_runner_logits(tiny_engine_factory, spied):
    eng = tiny_engine_factory()
    seen = spied(eng)
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=6, ignore_eos=True, logprobs=5)
    out = run(eng, [("a", PROMPT, params)])["a"].outputs[0]
    assert len(seen) == 6 and len(out.logprobs) == 6
    total = 0.0
    for row, token, got in zip(seen, out.token_ids, out.logprobs, strict=True):
        lp = torch.log_softmax(row[0], dim=-1)  # raw logits: temperature does not apply
        top = lp.topk(5)
        assert next(iter(got)) == token
        assert got[token].logprob == lp[token].item()
        assert got[token].rank == int((lp >= lp[token]).sum())
        for rank, (v, i) in enumerate(
            zip(top.values.tolist(), top.indices.tolist(), strict=True), 1
        ):
            assert got[i].logprob == v
            if i != token:
                assert got[i].rank == rank
        assert len(got) in (5, 6)
        assert got[token].decoded_token == eng.tokenizer.decode([token], skip_special_tokens=False)
        total += got[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_requests_that_do_not_ask_cost_nothing(tiny_engine_factory, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("logprobs computed for a request that did not ask")

    monkeypatch.setattr(model_runner, "logprob_dicts", forbidden)
    monkeypatch.setattr(model_runner, "prompt_logprob_dicts", forbidden)
    eng = tiny_engine_factory()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2)
    out = run(eng, [("a", PROMPT, params)])["a"]
    assert out.prompt_logprobs is None
    assert all(o.logprobs is None for o in out.outputs)


def prompt_logprobs_of(eng, prompt=PROMPT, k=3, rid="p"):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)
    return run(eng, [(rid, prompt, params)])[rid]


def test_prompt_logprobs_are_log_softmax_of_each_position(tiny_engine_factory, spied):
    eng = tiny_engine_factory(max_num_batched_tokens=512)
    seen = spied(eng)
    out = prompt_logprobs_of(eng)
    got = out.prompt_logprobs
    assert len(got) == len(PROMPT) and got[0] is None
    lp = torch.log_softmax(seen[0], dim=-1)  # one chunk: positions 0 .. len - 2 in one pass
    assert lp.shape[0] == len(PROMPT) - 1
    for j in range(1, len(PROMPT)):
        token = PROMPT[j]
        assert next(iter(got[j])) == token
        assert got[j][token].logprob == lp[j - 1, token].item()
        assert got[j][token].rank == int((lp[j - 1] >= lp[j - 1, token]).sum())
        assert [i for i in got[j] if i != token] == [
            i for i in lp[j - 1].topk(3).indices.tolist() if i != token
        ][: len(got[j]) - 1]
        assert got[j][token].decoded_token is not None
    assert out.num_cached_tokens == 0


def assert_close(a, b, tol=1e-5):
    """Float32 rounding apart (the chunks attend through different kernels), equal."""
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert list(x) == list(y)  # the same tokens in the same order
        for t in x:
            assert x[t].logprob == pytest.approx(y[t].logprob, rel=1e-6, abs=tol)
            assert x[t].rank == y[t].rank


@pytest.mark.parametrize("prompt_blocks", ["0", "1", "amx"])
def test_chunked_prompt_logprobs_equal_one_shot(tiny_engine_factory, monkeypatch, prompt_blocks):
    # chunks of 7 rows are within the block kernel's decode range, the one-shot step is not:
    # steps with prompt tokens must still take one path (else the logprobs depend on the
    # chunking, by ~1e-4 on the tiny model's weights quantized here), whichever it is
    monkeypatch.setenv("KVPOOL_SMALL_ROWS", "64")
    if prompt_blocks == "amx":  # AMX tiles (kernels/amx.cpp), where this CPU has them
        if kernels() is None or not kernels().has_amx():
            pytest.skip("no AMX-BF16 here: prompt steps never run on tiles")
        monkeypatch.setenv("KVPOOL_PROMPT_AMX", "1")
    else:
        monkeypatch.setenv("KVPOOL_PROMPT_AMX", "0")
        monkeypatch.setenv("KVPOOL_PROMPT_BLOCKS", prompt_blocks)
    one = prompt_logprobs_of(tiny_engine_factory(max_num_batched_tokens=512)).prompt_logprobs
    chunked_eng = tiny_engine_factory(max_num_batched_tokens=7)
    chunked = prompt_logprobs_of(chunked_eng).prompt_logprobs
    assert chunked_eng.stats().steps > 5
    # on the block kernel each layer's input is rounded to 16 bits per 32-block: the attention
    # kernels' float rounding (1e-7) can move a value by one step (3e-5 of its block's
    # largest), and layers carry it on: logprobs up to ~4e-4 apart here (1.4e-3 on SmolLM2
    # over 600 tokens, against 2.6e-5 on the float32 path). The kernel itself gives a row the
    # same bits whatever the step's size (test_quant.py).
    # On tiles each input is split into bfloat16 halves (16 bits together): a 1e-7 difference
    # can move the low half by one step (~8e-6 of the value), less than the block kernel's.
    tol = {"1": 1e-3, "amx": 1e-4}.get(prompt_blocks, 1e-5)
    assert_close(one, chunked, tol=tol)


def test_long_prompts_take_several_head_passes(tiny_engine_factory, spied, monkeypatch):
    # two chunkings compared to float32 rounding: prompt steps on BLAS, whatever this machine
    # measured for the tiny shapes (on the block kernel chunkings differ by ~1e-4: see above)
    monkeypatch.setenv("KVPOOL_PROMPT_BLOCKS", "0")
    prompt = (PROMPT * 8)[: PROMPT_LOGITS_ROWS + 40]
    eng = tiny_engine_factory(max_num_batched_tokens=512)
    seen = spied(eng)
    out = prompt_logprobs_of(eng, prompt, k=1)
    assert [len(x) for x in seen[:2]] == [PROMPT_LOGITS_ROWS, 39]  # then the sampled rows
    ref = prompt_logprobs_of(tiny_engine_factory(max_num_batched_tokens=16), prompt, k=1)
    assert_close(out.prompt_logprobs, ref.prompt_logprobs)


def test_prompt_logprobs_never_come_from_the_prefix_cache(tiny_engine_factory):
    eng = tiny_engine_factory()
    cold = prompt_logprobs_of(eng, rid="cold")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert run(eng, [("warm", PROMPT, params)])["warm"].num_cached_tokens > 0  # it is cached
    again = prompt_logprobs_of(eng, rid="again")
    assert again.num_cached_tokens == 0
    assert_close(cold.prompt_logprobs, again.prompt_logprobs)
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(tiny_engine_factory, monkeypatch):
    # a preempted prompt is computed again in other chunks: compared to float32 rounding on
    # BLAS, whatever this machine measured for the tiny shapes (a CI run measured the block
    # kernel faster for one of them, and the chunkings were 1.3e-4 apart)
    monkeypatch.setenv("KVPOOL_PROMPT_BLOCKS", "0")
    ref = prompt_logprobs_of(tiny_engine_factory())
    # 12 usable blocks x 4 tokens, 8 tokens a step: "other" grows to 40 tokens while "p"'s
    # prompt (37) is computed, so "p" (admitted last) is preempted and computed again
    eng = tiny_engine_factory(num_kv_blocks=13, enable_prefix_caching=False,
                              max_num_batched_tokens=8)  # fmt: skip
    other = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    done = run(eng, [("other", PROMPT[:20], other), ("p", PROMPT, params)])
    assert eng.stats().num_preemptions > 0
    assert_close(ref.prompt_logprobs, done["p"].prompt_logprobs)
    assert eng.pool.num_free_blocks == eng.pool.num_usable_blocks

"""LLMEngine on a tiny random model: batching, caching, chunking and preemption keep outputs."""

import pytest
import torch

from kvpool import LLM, SamplingParams
from kvpool.common.errors import BadRequestError, NotFoundError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n=5, base=20):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (base + 7 * i,), generator=g).tolist() for i in range(n)]


def run(eng, items, params=GREEDY):
    for i, p in enumerate(items):
        eng.add_request(f"r{i}", p, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(items))]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def alone(tiny_engine_factory):
    eng = tiny_engine_factory(enable_prefix_caching=False)
    return [tokens(run(eng, [p]))[0] for p in prompts()]


def test_batch_equals_alone(tiny_engine_factory, alone):
    eng = tiny_engine_factory(enable_prefix_caching=False)
    assert tokens(run(eng, prompts())) == alone


def test_chunked_prefill_equals_one_shot(tiny_engine_factory, alone):
    eng = tiny_engine_factory(max_num_batched_tokens=7, enable_prefix_caching=False)
    assert tokens(run(eng, prompts())) == alone
    assert eng.stats().steps > 20  # it really was cut into chunks


def test_prefix_hit_equals_cold_run(tiny_engine_factory, alone):
    eng = tiny_engine_factory()
    first = run(eng, prompts())
    assert all(o.num_cached_tokens == 0 for o in first)
    again = run(eng, prompts())
    assert tokens(again) == alone
    assert all(o.num_cached_tokens > 0 for o in again)
    s = eng.stats()
    assert s.prefix_cache_hits == sum(o.num_cached_tokens for o in again)
    assert s.prefix_cache_queries == 2 * sum(len(p) for p in prompts())


def test_preemption_keeps_outputs(tiny_engine_factory, alone):
    # 16 usable blocks x 4 tokens: five requests of up to 60 tokens cannot all run at once.
    eng = tiny_engine_factory(num_kv_blocks=17, enable_prefix_caching=False)
    assert tokens(run(eng, prompts())) == alone
    assert eng.stats().num_preemptions > 0
    assert eng.pool.num_free_blocks == eng.pool.num_usable_blocks


def test_forced_hash_collision_does_not_reuse_wrong_block(tiny_engine_factory, monkeypatch, alone):
    import kvpool.engine.kv_cache_manager as kvm

    def colliding(tokens, block_size, seed, *, start=0, parent=None, extra=b""):
        return [i.to_bytes(16, "little") for i in range(start, len(tokens) // block_size)]

    monkeypatch.setattr(kvm, "block_hashes", colliding)
    eng = tiny_engine_factory()
    outs = []
    for p in prompts():  # every prompt's block i has the same (forged) hash
        outs.append(run(eng, [p])[0])
    assert tokens(outs) == alone
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert eng.pool.stats.hash_collisions > 0


def test_too_long_request_is_rejected(tiny_engine_factory):
    eng = tiny_engine_factory(num_kv_blocks=9)  # 32 tokens of cache
    with pytest.raises(BadRequestError, match="maximum context length is 32"):
        eng.add_request("x", list(range(30)), SamplingParams(max_tokens=5))
    with pytest.raises(BadRequestError, match="empty"):
        eng.add_request("y", [], SamplingParams())
    with pytest.raises(BadRequestError, match="token ids"):
        eng.add_request("z", [1, 10**6], SamplingParams())
    assert not eng.has_unfinished_requests()


def test_abort_frees_blocks(tiny_engine_factory):
    eng = tiny_engine_factory()
    eng.add_request("a", prompts(1)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    eng.step()
    assert eng.pool.usage() > 0
    out = eng.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.pool.usage() == 0 and not eng.has_unfinished_requests()
    with pytest.raises(NotFoundError):
        eng.abort_request("a")


def test_stop_conditions(tiny_engine_factory):
    eng = tiny_engine_factory()
    p = prompts(1)[0]
    free = tokens(run(eng, [p]))[0]
    # stop token id: the 4th generated token stops it (and is kept, as vLLM does)
    out = run(
        eng,
        [p],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[free[3]]),
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == free[3]
    assert out.token_ids == free[: free.index(free[3]) + 1]
    # max_tokens
    out = run(eng, [p], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    # the model's EOS stops it unless ignore_eos
    eos = eng.tokenizer.eos_token_ids[0]
    eng.output.eos = frozenset({free[2]})
    out = run(eng, [p], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == free.index(free[2]) + 1
    out = run(eng, [p], SamplingParams(temperature=0, max_tokens=12, min_tokens=12))[0]
    assert len(out.outputs[0].token_ids) == 12
    assert eos is not None


def test_stop_string_truncates_text(tiny_engine_factory):
    eng = tiny_engine_factory()
    p = prompts(1)[0]
    text = run(eng, [p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    full = text.outputs[0].text
    assert len(full) >= 4
    stop = full[2:4]
    out = run(eng, [p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_engine_factory):
    eng = tiny_engine_factory()
    ps = prompts(3)
    sp = SamplingParams(
        temperature=5.0, top_p=0.9, top_k=50, seed=7, max_tokens=10, ignore_eos=True
    )
    alone = [tokens(run(eng, [p], sp))[0] for p in ps]
    together = tokens(run(eng, ps, sp))
    assert together == alone
    other = tokens(
        run(eng, ps[:1], SamplingParams(temperature=5.0, seed=8, max_tokens=10, ignore_eos=True))
    )[0]
    assert other != alone[0]


def test_llm_offline_api(tiny_model):
    llm = LLM(loaded_model=tiny_model, block_size=4, num_kv_blocks=64)
    outs = llm.generate(
        ["hello world", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    assert len(outs) == 2
    assert outs[0].prompt == "hello world"
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("hello world")
    assert outs[1].prompt_token_ids == [1, 2, 3]
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    chat = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    )
    assert chat[0].prompt_token_ids[-3:] == llm.get_tokenizer().encode("assistant\n")[-3:]


def test_requests_in_one_step_share_a_prefix(tiny_engine_factory, alone):
    eng = tiny_engine_factory(max_num_batched_tokens=256)
    p = prompts()[2]  # 34 tokens: 8 full blocks of 4
    shared = [p, [*p[:32], 7, 8, 9]]
    outs = run(eng, shared)
    assert eng.stats().steps == len(outs[0].outputs[0].token_ids)  # both prefilled in step 1
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens == 32  # blocks registered by the first, same step
    assert outs[0].outputs[0].token_ids == alone[2]
    solo = tiny_engine_factory(enable_prefix_caching=False)
    assert tokens(run(solo, [shared[1]])) == tokens(outs[1:])


def test_failed_step_forgets_blocks_it_registered(tiny_engine_factory, monkeypatch):
    eng = tiny_engine_factory()
    p = prompts()[0]

    def boom(chunks, copies=()):
        raise RuntimeError("injected")

    monkeypatch.setattr(eng.runner, "execute", boom)
    eng.add_request("a", p, GREEDY)
    with pytest.raises(RuntimeError):
        eng.step()
    eng.abort_request("a")
    monkeypatch.undo()
    out = run(eng, [p])[0]
    assert out.num_cached_tokens == 0  # nothing of the failed step's garbage is reused


def test_include_stop_str_and_chat_batches(tiny_model):
    llm = LLM(loaded_model=tiny_model, block_size=4, num_kv_blocks=64)
    free = (
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    assert len(free) >= 3
    stop = free[1:3]
    out = llm.generate(
        [[5, 6, 7]],
        SamplingParams(
            temperature=0,
            max_tokens=10,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
        ),
    )
    assert out[0].outputs[0].text == free[: free.index(stop) + len(stop)]
    convs = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "bb"}]]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(outs) == 2 and outs[0].prompt_token_ids != outs[1].prompt_token_ids


def test_import_kvpool_does_not_load_torch():
    import subprocess
    import sys

    code = "import sys, kvpool; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

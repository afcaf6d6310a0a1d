"""``n`` > 1 on the tiny model: the prompt is computed once, its sequences share its full blocks
(reference counts), a shared partial block is copied before a sequence writes into it, every
block is freed exactly once, and sequence i of seed s does not depend on anything else."""

import pytest
import torch
from support.engine import run_requests as run

from kvpool import LLM
from kvpool.common.errors import BadRequestError
from kvpool.engine.llm_engine import child_id
from kvpool.engine.sampling import SamplingParams

BS = 4  # the factory's block size
PROMPT = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(2)).tolist()


def sampled(n=3, seed=11, max_tokens=8, **kw):
    return SamplingParams(n=n, temperature=5.0, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, **kw)  # fmt: skip


def test_prompt_computed_once_full_blocks_shared_partial_block_copied(tiny_engine_factory):
    eng = tiny_engine_factory(enable_prefix_caching=False)
    eng.add_request("a", PROMPT, sampled())  # 10 tokens: 2 full blocks and 2 tokens in a third
    outs = eng.step()
    assert eng.stats().prompt_tokens == 10 and eng.scheduler.stats.steps == 1
    seqs = eng.requests["a"].seqs
    assert [s.request_id for s in seqs] == ["a", child_id("a", 1), child_id("a", 2)]
    assert [len(o.token_ids) for o in outs[0].outputs] == [1, 1, 1]
    tables = [eng.kv_manager.get_blocks(s) for s in seqs]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert [b.ref_cnt for b in tables[0]] == [3, 3, 3]
    partial = tables[0][2]
    before = eng.kv_cache[partial.block_id].clone()
    used = eng.pool.num_usable_blocks - eng.pool.num_free_blocks
    assert used == 3  # the prompt's blocks, once

    eng.step()  # every sequence writes position 10 into its block 2: two copies, one in place
    tables = [eng.kv_manager.get_blocks(s) for s in seqs]
    assert all(t[:2] == tables[0][:2] for t in tables) and tables[0][0].ref_cnt == 3
    thirds = [t[2] for t in tables]
    assert len({b.block_id for b in thirds}) == 3 and partial in thirds
    assert all(b.ref_cnt == 1 for b in thirds)
    assert eng.pool.num_usable_blocks - eng.pool.num_free_blocks == 5
    layer_k = (slice(None), 0)  # [layers, k|v, block_size, ...]: the prompt's 2 slots kept
    for b in thirds:
        got = eng.kv_cache[b.block_id]
        assert torch.equal(got[layer_k][:, :2], before[layer_k][:, :2])
        assert torch.equal(got[:, 1, :2], before[:, 1, :2])
    news = [eng.kv_cache[b.block_id][:, :, 2] for b in thirds]  # each wrote its own token
    assert not torch.equal(news[0], news[1]) or seqs[0].token_ids == seqs[1].token_ids

    while eng.has_unfinished_requests():
        eng.step()
    assert eng.pool.num_free_blocks == eng.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in eng.pool.blocks[1:])


def test_whole_block_prompts_need_no_copy(tiny_engine_factory):
    eng = tiny_engine_factory(enable_prefix_caching=False)
    eng.add_request("a", PROMPT[:8], sampled(n=2))
    eng.step()
    sched = eng.scheduler.schedule()
    assert sched.copies == [] and len(sched.chunks) == 2
    a, b = (eng.kv_manager.get_blocks(s) for s in eng.requests["a"].seqs)
    assert a[:2] == b[:2] and a[2] is not b[2] and a[0].ref_cnt == 2


def test_outputs_equal_n_requests_of_seed_plus_index(tiny_engine_factory):
    eng = tiny_engine_factory()
    out = run(eng, [("a", PROMPT, sampled())])["a"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    alone = [run(tiny_engine_factory(), [(f"s{i}", PROMPT, sampled(n=1, seed=11 + i))])[f"s{i}"]
             for i in range(3)]  # fmt: skip
    assert [o.token_ids for o in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # they really sample apart
    assert all(o.finish_reason == "length" for o in out.outputs)


def test_seeded_sequences_do_not_depend_on_batching(tiny_engine_factory):
    alone = run(tiny_engine_factory(), [("a", PROMPT, sampled())])["a"]
    g = torch.Generator().manual_seed(9)
    others = [(f"o{i}", torch.randint(0, 256, (5 + 9 * i,), generator=g).tolist(),
               sampled(n=2, seed=None)) for i in range(4)]  # fmt: skip
    eng = tiny_engine_factory(max_num_batched_tokens=9)
    batched = run(eng, [others[0], others[1], ("a", PROMPT, sampled()), *others[2:]])["a"]
    assert [o.token_ids for o in batched.outputs] == [o.token_ids for o in alone.outputs]
    assert eng.pool.num_free_blocks == eng.pool.num_usable_blocks


def test_greedy_n_gives_n_equal_answers(tiny_engine_factory):
    params = SamplingParams(n=4, temperature=0, max_tokens=6, ignore_eos=True)
    out = run(tiny_engine_factory(), [("a", PROMPT, params)])["a"]
    one = run(tiny_engine_factory(), [("b", PROMPT, SamplingParams(temperature=0, max_tokens=6,
                                                                  ignore_eos=True))])["b"]  # fmt: skip
    assert [o.token_ids for o in out.outputs] == [one.outputs[0].token_ids] * 4


def test_sequences_stop_on_their_own_and_free_their_blocks_once(tiny_engine_factory):
    eng = tiny_engine_factory(enable_prefix_caching=False)
    eos = eng.tokenizer.eos_token_ids[0]
    stops = list(range(40))
    params = SamplingParams(n=5, temperature=5.0, seed=3, max_tokens=12, stop_token_ids=stops)
    out = run(eng, [("a", PROMPT, params)])["a"]
    assert eos not in [t for o in out.outputs for t in o.token_ids[:-1]]
    assert len({len(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        if len(o.token_ids) < 12:
            last = o.token_ids[-1]
            assert (o.finish_reason, o.stop_reason) == ("stop", None if last == eos else last)
            assert last in stops or last == eos
        assert all(t not in stops for t in o.token_ids[:-1])
    assert eng.pool.num_free_blocks == eng.pool.num_usable_blocks
    assert not eng.requests and not eng._child_ids


def test_abort_frees_every_sequence_once(tiny_engine_factory):
    eng = tiny_engine_factory(enable_prefix_caching=False)
    eng.add_request("a", PROMPT, sampled(n=4, max_tokens=50))
    eng.add_request("b", PROMPT, sampled(n=2, max_tokens=50))
    for _ in range(4):
        eng.step()
    out = eng.abort_request("a")
    assert out.finished and [o.finish_reason for o in out.outputs] == ["abort"] * 4
    assert len(eng.scheduler.running) == 2
    eng.abort_request("b")
    assert eng.pool.num_free_blocks == eng.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in eng.pool.blocks[1:])
    # abort before the fork: n outputs, none with tokens
    eng.add_request("c", PROMPT, sampled(n=3))
    out = eng.abort_request("c")
    assert [(o.index, o.token_ids, o.finish_reason) for o in out.outputs] == [
        (0, [], "abort"), (1, [], "abort"), (2, [], "abort")]  # fmt: skip
    assert eng.pool.num_free_blocks == eng.pool.num_usable_blocks


def test_preempted_sequences_recompute_to_the_same_answers(tiny_engine_factory):
    ref = run(tiny_engine_factory(), [("a", PROMPT, sampled(n=3, max_tokens=16))])["a"]
    # 9 usable blocks: 3 sequences of 26 tokens need 3 x 7 blocks (2 shared): preemptions
    eng = tiny_engine_factory(num_kv_blocks=10)
    out = run(eng, [("a", PROMPT, sampled(n=3, max_tokens=16))])["a"]
    assert eng.stats().num_preemptions > 0
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
    assert eng.pool.num_free_blocks == eng.pool.num_usable_blocks


def test_logprobs_of_every_sequence(tiny_engine_factory):
    out = run(tiny_engine_factory(), [("a", PROMPT, sampled(logprobs=2))])["a"]
    firsts = [o.logprobs[0] for o in out.outputs]
    # the first tokens come from the same logits: the same top tokens and values
    tops = [{t: lp.logprob for t, lp in d.items() if lp.rank <= 2} for d in firsts]
    assert all(t == tops[0] for t in tops)
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        assert [next(iter(d)) for d in o.logprobs] == o.token_ids


def test_ids_of_sequences_are_reserved(tiny_engine_factory):
    eng = tiny_engine_factory()
    eng.add_request("a", PROMPT, sampled(n=2))
    with pytest.raises(BadRequestError):
        eng.add_request(child_id("a", 1), PROMPT, sampled(n=1))
    eng.add_request(child_id("x", 1), PROMPT, sampled(n=1))
    with pytest.raises(BadRequestError):
        eng.add_request("x", PROMPT, sampled(n=2))  # its sequence 1 would take a used id
    run(eng, [])
    eng.add_request(child_id("a", 1), PROMPT, sampled(n=1))  # free again once "a" is done


def test_offline_llm_returns_n_outputs(tiny_model):
    llm = LLM(loaded_model=tiny_model, block_size=4, num_kv_blocks=64)
    outs = llm.generate([PROMPT, PROMPT[:6]], SamplingParams(n=2, temperature=0, max_tokens=3))
    assert [[o.index for o in r.outputs] for r in outs] == [[0, 1], [0, 1]]
    assert all(len(o.token_ids) == 3 for r in outs for o in r.outputs)
    llm.engine.close()

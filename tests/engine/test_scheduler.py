"""Scheduler decisions with exact expectations (no model: steps are simulated)."""

from kvpool.common.hashing import namespace_seed
from kvpool.engine.block_pool import BlockPool
from kvpool.engine.kv_cache_manager import KVCacheManager
from kvpool.engine.request import Request, RequestStatus
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, max_seqs=8, budget=16, caching=True):
    pool = BlockPool(num_blocks, enable_caching=caching)
    kv = KVCacheManager(pool, block_size, namespace_seed("test"))
    return Scheduler(SchedulerConfig(max_seqs, budget), kv), pool


def req(rid, n, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(temperature=0))


def run_step(s):
    """Apply a schedule as the engine would: advance computed tokens, sample token 1."""
    out = s.schedule()
    for ch in out.chunks:
        ch.request.num_computed_tokens = ch.start + ch.num_tokens
        s.kv.cache_full_blocks(ch.request)
        if ch.completes:
            ch.request.append_token(1)
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks], out


def test_long_prompt_is_chunked_and_decodes_go_first():
    s, _ = make(budget=16)
    a = req("a", 5)
    s.add(a)
    assert run_step(s)[0] == [("a", 0, 5)]
    b = req("b", 40, start=100)
    s.add(b)
    # a decodes (1 token) first; b gets the remaining 15 tokens of the budget.
    assert run_step(s)[0] == [("a", 5, 1), ("b", 0, 15)]
    assert run_step(s)[0] == [("a", 6, 1), ("b", 15, 15)]
    assert run_step(s)[0] == [("a", 7, 1), ("b", 30, 10)]
    assert len(b.output_token_ids) == 1  # sampled once its prompt completed
    assert run_step(s)[0] == [("a", 8, 1), ("b", 40, 1)]


def test_max_num_seqs_bounds_the_batch():
    s, _ = make(max_seqs=2, budget=64)
    for i in range(3):
        s.add(req(f"r{i}", 4, start=10 * i))
    got, _ = run_step(s)
    assert [g[0] for g in got] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_prefix_hit_skips_cached_blocks_and_keeps_last_token():
    s, _ = make(block_size=4, budget=64)
    a = req("a", 12)
    s.add(a)
    run_step(s)
    s.finish(a)
    b = req("b", 12)  # the same 12 tokens: 3 full blocks cached, but 1 token must be computed
    s.add(b)
    got, _ = run_step(s)
    assert got == [("b", 8, 4)]
    assert b.num_cached_tokens == 8
    assert s.stats.prefix_queries == 24 and s.stats.prefix_hits == 8
    c = req("c", 14)  # 3 full blocks hit, 2 tokens to compute
    s.add(c)
    got, _ = run_step(s)
    assert ("c", 12, 2) in got


def test_preemption_frees_latest_request_and_requeues_it_first():
    # 9 usable blocks of 4 tokens; two requests of 16 tokens take 4 blocks each.
    s, pool = make(num_blocks=10, block_size=4, budget=64, caching=False)
    a, b = req("a", 16), req("b", 16, start=50)
    s.add(a)
    s.add(b)
    run_step(s)
    assert pool.num_free_blocks == 1
    # Both need a 5th block for token 17: one free block, so b (the latest) is preempted.
    got, out = run_step(s)
    assert got == [("a", 16, 1)]
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and s.stats.preemptions == 1
    assert b.block_ids == []
    # After a finishes, b is recomputed: prompt + its sampled token.
    s.finish(a)
    got, _ = run_step(s)
    assert got == [("b", 0, 17)]


def test_waiting_request_waits_when_blocks_are_short():
    s, _pool = make(num_blocks=6, block_size=4, budget=64, caching=False)
    s.add(req("a", 16))
    run_step(s)
    s.add(req("b", 8, start=40))
    got, _ = run_step(s)
    assert got == [("a", 16, 1)]  # b needs 2 blocks, none are left after a's 5th
    assert [r.request_id for r in s.waiting] == ["b"]

"""The engine's KV connector on the real pool (an embedded master + node, real transfers)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvpool import SamplingParams
from kvpool.common.errors import KVPoolError
from kvpool.common.hashing import block_hashes
from kvpool.engine.connectors.store import StoreConnector
from kvpool.protocol.kv_object import MAGIC, block_key
from kvpool.store.embedded import EmbeddedStore


@pytest.fixture
def pool():
    with EmbeddedStore(memory="64MiB") as store:
        yield store


def run(eng, prompt, sp, rid="r"):
    eng.add_request(rid, prompt, sp)
    outs = []
    while eng.has_unfinished_requests():
        outs = eng.step() or outs
    return outs[-1]


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefix_computed_by_one_engine_is_loaded_by_another(pool, tiny_engine_factory):
    prompt = prompt_of(1, 41)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a_conn = StoreConnector(pool)
    a = tiny_engine_factory(connector=a_conn)
    cold = run(a, prompt, sp).outputs[0].token_ids
    hashes = a.pool.cached_hashes()
    assert a_conn.wait_saved(hashes, timeout=10)
    a._release_saved()
    a.close()
    assert a_conn.stats.saved_blocks >= 10
    assert not a._saving and a.pool.usage() == 0  # every save gave its block back
    assert all(pool.batch_exists([block_key(h) for h in hashes]))

    b_conn = StoreConnector(pool)
    b = tiny_engine_factory(connector=b_conn)
    out = run(b, prompt, sp)
    b.close()
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens == 40  # 10 blocks of 4 from the pool; the last token computed
    assert b_conn.stats.loaded_blocks == 10
    assert b_conn.stats.loaded_bytes == 10 * b_conn.block_bytes


def test_stored_object_is_header_plus_block_bytes(pool, tiny_engine_factory):
    conn = StoreConnector(pool)
    eng = tiny_engine_factory(connector=conn)
    prompt = prompt_of(2, 9)
    run(eng, prompt, SamplingParams(temperature=0, max_tokens=1))
    first = next(iter(eng.pool.cached_hashes()))
    assert conn.wait_saved([first], 10)
    raw = pool.get(block_key(first))
    assert raw[:4] == MAGIC
    block = eng.pool.lookup(first, tuple(prompt[:4]))
    assert block is not None
    payload = raw[-conn.block_bytes :]
    assert payload == eng.kv_cache[block.block_id].contiguous().view(torch.uint8).numpy().tobytes()
    eng.close()


def test_forged_tokens_end_the_loaded_prefix(pool, tiny_engine_factory):
    prompt = prompt_of(3, 20)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a_conn = StoreConnector(pool)
    a = tiny_engine_factory(connector=a_conn)
    cold = run(a, prompt, sp).outputs[0].token_ids
    hashes = a.pool.cached_hashes()
    assert a_conn.wait_saved(hashes, 10)
    a.close()
    # Replace block 2's object with one whose header names other tokens.
    b_conn = StoreConnector(pool)
    b = tiny_engine_factory(connector=b_conn)
    keys = [block_key(x) for x in block_hashes(prompt, 4, b.kv_manager.hash_seed)]
    forged = bytearray(pool.get(keys[2]))
    forged[16] ^= 0xFF  # first token id of the header
    pool.remove(keys[2], force=True)
    pool.put(keys[2], bytes(forged))
    out = run(b, prompt, sp)
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens == 8  # blocks 0 and 1 only
    assert b_conn.stats.token_mismatches == 1
    b.close()


def test_unreachable_pool_falls_back_to_local_compute(tiny_engine_factory):
    store = EmbeddedStore(memory="16MiB")
    try:
        conn = StoreConnector(store, retry_after_s=60)
        eng = tiny_engine_factory(connector=conn)
        prompt = prompt_of(4, 17)
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        want = run(eng, prompt, sp, "warm").outputs[0].token_ids
        assert conn.wait_saved(eng.pool.cached_hashes(), 10)
        store.server.close()  # the master goes away
        assert eng.reset_prefix_cache() > 0
        out = run(eng, prompt, sp, "after")
        assert out.outputs[0].token_ids == want
        assert not conn.pool_up() and conn.stats.pool_errors >= 1
        eng.close()
        with pytest.raises(KVPoolError):
            store.exists("x")
    finally:
        store.close()


def test_a_reset_after_the_saves_forgets_every_cached_block(tiny_engine_factory):
    """Blocks are held for the saver until a step sees their saves finished; a reset right
    after ``wait_saved`` lets those go first (before, the prefix stayed cached and the next
    run of the same prompt was a local hit: the slow-tier test timed one at 13 ms)."""
    store = EmbeddedStore(memory="16MiB")
    try:
        conn = StoreConnector(store)
        eng = tiny_engine_factory(connector=conn)
        prompt = prompt_of(4, 17)
        sp = SamplingParams(temperature=0, max_tokens=1)
        run(eng, prompt, sp, "warm")
        cached = eng.pool.cached_hashes()
        assert len(cached) == 4 and conn.wait_saved(cached, 10)
        assert eng.reset_prefix_cache() == 4
        assert eng.pool.cached_hashes() == []
        eng.close()
    finally:
        store.close()


def warm_pool(pool, tiny_engine_factory, prompt, sp):
    """Compute ``prompt`` once so its blocks sit in ``pool``; its cold output and hashes."""
    conn = StoreConnector(pool)
    eng = tiny_engine_factory(connector=conn)
    cold = run(eng, prompt, sp).outputs[0].token_ids
    hashes = eng.pool.cached_hashes()
    assert conn.wait_saved(hashes, 10)
    eng.close()
    return cold, hashes


def test_pool_lookups_and_loads_run_off_the_engine_thread(pool, tiny_engine_factory):
    prompt = prompt_of(5, 41)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold, _ = warm_pool(pool, tiny_engine_factory, prompt, sp)
    threads = []
    for name in ("batch_tiers", "batch_get_into_parts"):
        real = getattr(pool, name)

        def spy(*a, _real=real, _name=name, **kw):
            threads.append((_name, threading.current_thread().name))
            return _real(*a, **kw)

        setattr(pool, name, spy)
    conn = StoreConnector(pool)
    eng = tiny_engine_factory(connector=conn)
    out = run(eng, prompt, sp)
    eng.close()
    assert out.outputs[0].token_ids == cold and out.num_cached_tokens == 40
    assert eng.scheduler.stats.loads_started == 1
    assert ("batch_tiers", "kvpool-kv-lookup") in threads
    assert ("batch_get_into_parts", "kvpool-kv-load") in threads
    assert all(t.startswith("kvpool-kv-") for _, t in threads), threads  # never the step


def test_synchronous_switch_loads_inside_the_step(pool, tiny_engine_factory):
    prompt = prompt_of(6, 41)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold, _ = warm_pool(pool, tiny_engine_factory, prompt, sp)
    conn = StoreConnector(pool, async_load=False)
    eng = tiny_engine_factory(connector=conn)
    out = run(eng, prompt, sp)
    eng.close()
    assert out.outputs[0].token_ids == cold and out.num_cached_tokens == 40
    assert eng.scheduler.stats.loads_started == 0 and conn.stats.loaded_blocks == 10


def test_stale_view_costs_a_short_load_and_recompute(pool, tiny_engine_factory):
    prompt = prompt_of(7, 41)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold, _ = warm_pool(pool, tiny_engine_factory, prompt, sp)
    conn = StoreConnector(pool)
    eng = tiny_engine_factory(connector=conn)
    hashes = block_hashes(prompt, 4, eng.kv_manager.hash_seed)
    conn.view.mark(hashes, True)  # believed present...
    pool.remove(block_key(hashes[5]), force=True)  # ...but block 5 is gone
    out = run(eng, prompt, sp)
    eng.close()
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens == 20  # blocks 0-4 loaded, the rest recomputed
    assert eng.scheduler.stats.loads_partial == 1
    # the recomputed blocks were saved back, and the view learned it from the saves
    assert pool.exists(block_key(hashes[5]))
    assert conn.view.leading(hashes[:10]) == (10, True)


def test_lookups_start_when_requests_arrive_not_when_scheduled(pool, tiny_engine_factory):
    """Three prompts whose prefixes sit in the pool, added together: their pool lookups run
    on arrival, before any step, so none waits a step for another's answer; one lookup each."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [prompt_of(20 + i, 41) for i in range(3)]
    colds = [warm_pool(pool, tiny_engine_factory, p, sp)[0] for p in prompts]
    conn = StoreConnector(pool)
    eng = tiny_engine_factory(connector=conn)
    hashes = [block_hashes(p[:40], 4, eng.kv_manager.hash_seed) for p in prompts]
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, sp)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            conn.view.leading(h) != (10, True) for h in hashes
        ):
            time.sleep(0.005)
        assert [conn.view.leading(h) for h in hashes] == [(10, True)] * 3  # before any step
        assert eng.scheduler.stats.steps == 0
        eng.step()  # all three are admitted with their loads in the first step
        assert eng.scheduler.stats.loads_started == 3
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id] = o
    finally:
        eng.close()
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(3)] == colds
    assert all(outs[f"r{i}"].num_cached_tokens == 40 for i in range(3))
    assert conn._prefetch.lookups == 3  # the scheduler asked nothing again

"""Fetch only when it pays: the load-or-recompute decision, and an engine that makes it."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvpool import SamplingParams
from kvpool.engine.connectors.fetch_policy import FetchPolicy, LoadCostModel
from kvpool.engine.connectors.store import StoreConnector
from kvpool.store.embedded import EmbeddedStore

KB = 1000


def test_load_cost_model_separates_latency_from_bandwidth():
    m = LoadCostModel()
    assert m.predict(1000) is None
    for n in (10, 50, 100, 200, 400):  # 5 ms + 1 ms per 100 KB
        m.observe(n * KB, 0.005 + n * 1e-5)
    assert m.predict(300 * KB) == pytest.approx(0.008, rel=0.01)
    one = LoadCostModel()
    one.observe(100 * KB, 0.01)  # one size only: proportional
    assert one.predict(50 * KB) == pytest.approx(0.005)


def test_load_cost_model_never_predicts_a_small_load_slower_than_a_larger_one_seen():
    # loads of 4-25 blocks whose times are noisy: the least-squares intercept alone sets the
    # prediction below 4 blocks, and here it overshoots; the fastest 4-block load caps it
    m = LoadCostModel()
    for n, seconds in ((4, 0.030), (4, 0.031), (10, 0.045), (16, 0.046), (25, 0.050)):
        m.observe(n * 100 * KB, seconds)
    per_byte, latency = np.polyfit([4e5, 4e5, 1e6, 1.6e6, 2.5e6],
                                   [0.030, 0.031, 0.045, 0.046, 0.050], 1)  # fmt: skip
    assert latency + per_byte * 2e5 > 0.030  # what the fit alone would say for 2 blocks
    assert m.predict(2 * 100 * KB) == pytest.approx(0.030)
    # within the measured sizes the fit stands where no larger load was faster
    assert m.predict(20 * 100 * KB) == pytest.approx(latency + per_byte * 2e6)


def test_one_small_load_seen_does_not_rule_out_larger_ones():
    # the first load was 2 blocks in 60 ms, nearly all of it fixed cost; scaled by the bytes,
    # 32 blocks would take 0.96 s, more than computing them (0.5 s): without a second size the
    # policy would never load, so never learn. Between the floor (60 ms) and that, it measures
    p = FetchPolicy(block_bytes=100 * KB, block_size=16)
    p.observe_load(2, 0.060)
    p.compute_s = lambda tokens: 0.001 * tokens
    p.step_s = lambda: 0.02
    assert p.loads.predict(32 * 100 * KB) == pytest.approx(0.96)
    assert p.decide(32) == (32, None) and p.stats.measuring == 1
    assert p.decide(2)[0] == 0  # its own size: the measurement stands (60 + 20 ms > 32 ms)
    p.observe_load(32, 0.100)  # two sizes: the fit takes over, no more measuring
    assert p.decide(32)[0] == 32 and p.stats.measuring == 1
    slow = FetchPolicy(block_bytes=100 * KB, block_size=16)
    slow.observe_load(2, 0.600)  # even its fixed cost is more than computing 32 blocks
    slow.compute_s, slow.step_s = p.compute_s, p.step_s
    assert slow.decide(32) == (0, None)


def policy(latency_s: float, per_block_s: float, compute_token_s: float, step_s: float = 0.02):
    p = FetchPolicy(block_bytes=100 * KB, block_size=16)
    for n in (1, 4, 16, 64):
        p.observe_load(n, latency_s + n * per_block_s)
    p.compute_s = lambda tokens: compute_token_s * tokens
    p.step_s = lambda: step_s
    return p


def test_short_prefixes_are_recomputed_long_ones_loaded():
    # a load costs 30 ms + a step (20 ms) + 1 ms a block; computing costs 1 ms a token
    p = policy(latency_s=0.030, per_block_s=0.001, compute_token_s=0.001)
    assert p.decide(2) == (0, None)  # 32 tokens: 32 ms of compute < 52 ms of loading
    n, predicted = p.decide(32)  # 512 tokens: 512 ms of compute > 82 ms of loading
    assert n == 32 and predicted == pytest.approx(0.082, rel=0.01)
    assert not p.worth_looking_up(2) and p.worth_looking_up(32)
    assert (p.stats.loads, p.stats.recomputes) == (1, 1)
    assert p.stats.saved_compute_seconds == pytest.approx(0.512)


def test_a_tie_takes_the_option_taken_less_recently_at_that_size():
    """Predictions within CLOSE of each other cannot settle it (the slow-tier CI test: a 2-block
    load predicted at 68 ms, its recompute at 68 ms, while they took 54 and 90 ms): the option
    not taken lately for prefixes of that size is taken, so each side gets a fresh figure, and
    the next decision is made on them. Clear cases are not explored."""
    p = policy(latency_s=0.030, per_block_s=0.001, compute_token_s=0.0015, step_s=0.020)
    assert p.worth_looking_up(2)  # 52 ms of loading against 48 ms of compute: a tie
    assert [p.decide(2)[0] for _ in range(3)] == [2, 0, 2] and p.stats.ties == 3
    p.observe_load(2, 0.005)  # the load, measured again, turned out fast: no longer a tie
    assert p.decide(2)[0] == 2 and p.decide(2)[0] == 2 and p.stats.ties == 3
    clear = policy(latency_s=0.030, per_block_s=0.001, compute_token_s=0.0005)  # 16 ms
    assert not clear.worth_looking_up(2)
    assert [clear.decide(2)[0] for _ in range(3)] == [0, 0, 0] and clear.stats.ties == 0


def test_a_link_slower_than_compute_loads_nothing():
    p = policy(latency_s=0.001, per_block_s=0.05, compute_token_s=0.001)  # 50 ms a block
    assert [p.decide(n)[0] for n in (1, 8, 64, 256)] == [0, 0, 0, 0]


def test_queued_loads_count_against_a_new_one():
    p = policy(latency_s=0.010, per_block_s=0.004, compute_token_s=0.001)
    assert p.decide(8)[0] == 8  # 8 blocks: 62 ms of loading < 128 ms of compute
    assert p.decide(8, backlog=64)[0] == 0  # behind 64 queued blocks: 318 ms


def test_no_measurement_or_a_stale_one_loads_to_measure(monkeypatch):
    fresh = FetchPolicy(block_bytes=100 * KB, block_size=16)
    fresh.compute_s = lambda tokens: 1e-6 * tokens
    assert fresh.decide(4)[0] == 4 and fresh.stats.measuring == 1
    p = policy(latency_s=0.001, per_block_s=0.05, compute_token_s=0.001)
    assert p.decide(8)[0] == 0 and not p.wants_probe()
    later = time.monotonic() + p.remeasure_s + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert p.worth_looking_up(1)  # stale: look up, so that a hit can be probed
    assert p.decide(8)[0] == 0  # the old figures still decide...
    assert p.wants_probe() and not p.wants_probe()  # ...and one background probe refreshes them
    assert p.stats.probes == 1


def test_realized_waits_are_counted_against_predictions():
    p = policy(latency_s=0.030, per_block_s=0.001, compute_token_s=0.001)
    _, predicted = p.decide(32)
    p.observe_wait(0.1, predicted)
    assert p.stats.predicted_load_seconds == pytest.approx(predicted)
    assert p.stats.realized_load_seconds == pytest.approx(0.1)


def run(eng, prompt, sp, rid):
    eng.add_request(rid, prompt, sp)
    out = None
    deadline = time.monotonic() + 30
    while eng.has_unfinished_requests() and time.monotonic() < deadline:
        out = eng.step() or out
    return out[-1]


def test_each_tier_has_its_own_load_costs():
    """The same prefix is loaded from DRAM and recomputed when it sits on a slow SSD tier;
    an unmeasured tier is loaded once, to measure it."""
    p = policy(latency_s=0.001, per_block_s=0.0001, compute_token_s=0.001)
    assert p.decide(8, tier="ssd")[0] == 8 and p.stats.measuring == 1  # SSD not measured yet
    for n in (1, 4, 16, 64):
        p.observe_load(n, 0.05 + n * 0.05, tier="ssd")  # 50 ms per 16-token block: slow
    assert p.decide(8, tier="dram")[0] == 8
    assert p.decide(8, tier="ssd")[0] == 0
    assert p.predicted_load_s(8, tier="ssd") > 10 * p.predicted_load_s(8, tier="dram")
    assert p.stats.loads == 2 and p.stats.recomputes == 1


def test_the_pool_view_keeps_the_slowest_tier():
    from kvpool.engine.connectors.prefetch import PoolView

    v = PoolView()
    v.mark([b"a", b"b", b"c"], ["dram", "ssd", None])
    assert v.leading([b"a", b"b", b"c"]) == (2, True)
    assert v.tier([b"a"]) == "dram" and v.tier([b"a", b"b"]) == "ssd"
    v.mark([b"b"], True)  # loaded since: still where it was known to be until a lookup
    assert v.tier([b"a", b"b"]) == "ssd" and v.on_ssd([b"a", b"b", b"c"]) == [b"b"]
    v.mark([b"b"], ["dram"])  # a fresh lookup: promoted
    assert v.tier([b"a", b"b"]) == "dram" and v.on_ssd([b"b"]) == []


class SlowReads:
    """The real pool with reads that take at least ``delay_s`` longer (a slow tier): the
    comparison below must not depend on how busy the machine is (the tiny model's compute and
    an in-process read are both well under a millisecond, too close to call)."""

    def __init__(self, pool, delay_s: float) -> None:
        self._pool, self._delay_s = pool, delay_s

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def batch_get_into_parts(self, keys, buffers):
        time.sleep(self._delay_s)
        return self._pool.batch_get_into_parts(keys, buffers)


def test_an_engine_whose_compute_is_cheap_stops_loading(tiny_engine_factory):
    """The tiny model computes a block in microseconds: once a load (from a slow tier) has
    been measured, the pool's copies of later prefixes are recomputed instead, with the same
    tokens."""
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (41,), generator=gen).tolist() for _ in range(4)]
    with EmbeddedStore(memory="64MiB") as pool:
        warm_conn = StoreConnector(pool, fetch_policy=False)
        warm = tiny_engine_factory(connector=warm_conn)
        colds = [run(warm, p, sp, f"w{i}").outputs[0].token_ids for i, p in enumerate(prompts)]
        assert warm_conn.wait_saved(list(warm.pool.cached_hashes()), 10)
        warm.close()
        conn = StoreConnector(SlowReads(pool, 0.1))
        eng = tiny_engine_factory(connector=conn)
        for _ in range(40):  # steps for the cost model to fit this engine's compute
            run(eng, [1, 2, 3], SamplingParams(max_tokens=1), f"fit{_}")
        outs = [run(eng, p, sp, f"r{i}") for i, p in enumerate(prompts)]
        eng.close()
    assert [o.outputs[0].token_ids for o in outs] == colds
    st = eng.stats()
    assert st.kv_fetch_loads == 1  # the first, to measure
    assert st.kv_fetch_recomputes + st.kv_fetch_skipped == 3
    assert outs[0].num_cached_tokens == 40
    assert [o.num_cached_tokens for o in outs[1:]] == [0, 0, 0]
    # a prompt not worth looking up is not looked up on arrival either
    assert conn._prefetch.lookups == 1 + st.kv_fetch_recomputes
    assert conn.policy.stats.measuring == 1 and conn.policy.loads.predict(1) is not None


class OldMaster:
    """The real pool behind a master from before ``batch_tiers`` (what it answers then)."""

    def __init__(self, pool) -> None:
        self._pool, self.asked = pool, []

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def batch_tiers(self, keys):
        from kvpool.common.errors import BadRequestError

        self.asked.append("batch_tiers")
        raise BadRequestError("unknown method 'batch_tiers'")

    def batch_exists(self, keys):
        self.asked.append("batch_exists")
        return self._pool.batch_exists(keys)


def test_a_master_without_tiers_is_asked_whether_blocks_exist(tiny_engine_factory):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    with EmbeddedStore(memory="64MiB") as pool:
        warm_conn = StoreConnector(pool, fetch_policy=False)
        warm = tiny_engine_factory(connector=warm_conn)
        cold = run(warm, prompt, sp, "w").outputs[0].token_ids
        assert warm_conn.wait_saved(list(warm.pool.cached_hashes()), 10)
        warm.close()
        old = OldMaster(pool)
        conn = StoreConnector(old, fetch_policy=False)
        eng = tiny_engine_factory(connector=conn)
        outs = [run(eng, prompt, sp, f"r{i}") for i in range(2)]
        eng.close()
    assert outs[0].outputs[0].token_ids == cold and outs[0].num_cached_tokens == 40
    assert old.asked[0] == "batch_tiers" and "batch_tiers" not in old.asked[1:]  # asked once
    assert "batch_exists" in old.asked and conn.pool_up()

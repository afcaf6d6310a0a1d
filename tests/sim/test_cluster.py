"""The conductor in the loop: its own policy code, admission, stale views; the pool's own
eviction; caches evicting between routing and use."""

from __future__ import annotations

from simkit import request, toy_profile

from kvpool.conductor.cluster_state import Placement
from kvpool.conductor.policies import Policy
from kvpool.sim.run import simulate
from kvpool.sim.systems import SimConfig, SystemSpec


def cfg(profile, **kw) -> SimConfig:
    return SimConfig(
        profile,
        4,
        **{"decode_prefill_tokens": 0, "decode_prefill_gain": 0.0, "poll_interval": 0.0, **kw},
    )


class Spy(Policy):
    """Always the last prefill worker and the first decode worker; remembers what it saw."""

    name = "spy"

    def __init__(self) -> None:
        self.seen: list[dict[str, int]] = []

    def choose_prefill(self, snap, req):
        ws = sorted((w for w in snap.workers if w.prefills), key=lambda w: w.id)
        self.seen.append({w.id: w.local_prefix_blocks(list(req.block_hashes)) for w in ws})
        return Placement(ws[-1].id, 0.0)

    def choose_decode(self, snap, req, ttft_s):
        return Placement(min(w.id for w in snap.workers if w.role == "decode"), 0.0)


def test_a_swapped_in_policy_drives_the_simulation():
    toy = toy_profile()
    spy = Spy()
    system = SystemSpec("spy", spy, prefill=3, decode=2, pool=False)
    reqs = [request(i, i * 1.0, 10, 2, "a", "b") for i in range(4)]
    r = simulate(system, cfg(toy), reqs)
    assert [x.prefill_node for x in r.records] == ["prefill-2"] * 4
    assert [x.decode_node for x in r.records] == ["decode-0"] * 4
    # the snapshots it was handed are the simulated caches: a and b on prefill-2 after the first
    assert spy.seen[0] == {"prefill-0": 0, "prefill-1": 0, "prefill-2": 0}
    assert spy.seen[1] == {"prefill-0": 0, "prefill-1": 0, "prefill-2": 2}
    assert r.summary["prefix_hit_rate"] == 3 * 8 / 40


def test_cache_aware_follows_the_prefix_random_scatters_it():
    toy = toy_profile()
    reqs = [request(i, i * 1.0, 10, 2, "a", "b") for i in range(12)]
    aware = simulate(SystemSpec("c", "cache_aware", prefill=4, decode=1, pool=False),
                     cfg(toy), reqs)  # fmt: skip
    assert {x.prefill_node for x in aware.records} == {"prefill-0"}
    assert aware.summary["prefix_hit_rate"] == 11 * 8 / 120
    rand = simulate(SystemSpec("r", "random", prefill=4, decode=1, pool=False), cfg(toy), reqs)
    assert len({x.prefill_node for x in rand.records}) > 1
    assert rand.summary["prefix_hit_rate"] < aware.summary["prefix_hit_rate"]


def test_admission_rejections_are_counted_by_reason():
    toy = toy_profile()
    reqs = [request(0, 0.0, 10, 2, "a", "b"), request(1, 0.0, 10, 2, "c", "d")]
    tight = simulate(SystemSpec("s", "least_load", prefill=1, decode=1, pool=False),
                     cfg(toy, slo_ttft=1e-4), reqs)  # fmt: skip
    assert [x.status for x in tight.records] == ["rejected", "rejected"]
    assert tight.summary["rejected"] == 2 and tight.summary["sim_rejected_ttft_slo"] == 2
    assert tight.records[0].http_status == 429 and tight.records[0].error == "ttft_slo"
    measured = simulate(SystemSpec("s", "least_load", prefill=1, decode=1, pool=False),
                        cfg(toy, slo_ttft=1e-4, admission=False), reqs)  # fmt: skip
    assert measured.summary["completed"] == 2 and measured.summary["goodput_ratio"] == 0
    full = simulate(SystemSpec("s", "least_load", prefill=1, decode=1, pool=False),
                    cfg(toy, max_inflight=1), reqs)  # fmt: skip
    assert [x.status for x in full.records] == ["ok", "rejected"]
    assert full.summary["sim_rejected_queue_full"] == 1
    tbt = simulate(SystemSpec("s", "least_load", prefill=1, decode=1, pool=False),
                   cfg(toy, slo_tbt=1e-4), reqs)  # fmt: skip
    assert tbt.summary["sim_rejected_tbt_slo"] == 2


def test_a_stale_view_mispredicts_the_prefix():
    toy = toy_profile()
    reqs = [request(0, 0.0, 10, 2, "a", "b"), request(1, 0.5, 10, 2, "a", "b")]
    system = SystemSpec("s", "cache_aware", prefill=1, decode=1, pool=False)
    fresh = simulate(system, cfg(toy), reqs).records[1]
    assert fresh.predicted_hit_tokens == 8 and fresh.route_outcome == "as_predicted"
    # polled at 0.0 (before request 0's blocks were cached) and not again before 1.0
    stale = simulate(system, cfg(toy, poll_interval=1.0), reqs).records[1]
    assert stale.predicted_hit_tokens == 0 and stale.realized_hit_tokens == 8
    assert stale.route_outcome == "more_stale_view"


def test_blocks_evicted_between_routing_and_use():
    small = toy_profile(local_cache_blocks=3)
    many = [f"x{i}" for i in range(24)]  # 100 tokens: two prefill steps of 64 + 36
    reqs = [request(0, 0.0, 10, 1, "a", "b"), request(1, 0.1, 100, 1, *many),
            request(2, 0.1001, 64, 1, *many[:15]), request(3, 0.1002, 10, 1, "a", "b")]  # fmt: skip
    r = simulate(SystemSpec("s", "cache_aware", prefill=1, decode=1, pool=False),
                 cfg(small), reqs)  # fmt: skip
    late = r.records[3]
    # routed while a and b were cached; looked up after request 1's blocks pushed them out
    assert late.predicted_hit_tokens == 8 and late.realized_hit_tokens == 0
    assert late.route_outcome == "fewer_evicted"
    assert r.summary["sim_route_fewer_evicted"] == 1 and r.summary["sim_local_cache_evictions"] > 0


def test_the_pool_evicts_with_the_stores_own_code():
    def run(blocks: int):
        profile = toy_profile(local_cache_blocks=0)  # every reuse goes through the pool
        conf = cfg(profile, pool_blocks_per_node=blocks, pool_nodes=1)
        # one request every 20 s (read leases last 10 s), each with 2 fresh blocks, then the
        # first chain again
        reqs = [request(i, 20.0 * i, 10, 1, f"a{i}", f"b{i}") for i in range(6)]
        reqs.append(request(6, 200.0, 10, 1, "a0", "b0"))
        system = SystemSpec("s", "cache_aware", prefill=2, decode=1, pool=True)
        return simulate(system, conf, reqs)

    big, small = run(100), run(10)
    assert big.summary["sim_pool_evictions"] == 0 and big.records[6].cached_tokens == 8
    # 10 blocks: above 9 (the high watermark) the master evicts down to 8, coldest first:
    # the first chain went, the request that wanted it computes it again
    assert small.summary["sim_pool_evictions"] > 0
    assert small.summary["sim_pool_used_blocks"] <= 9
    assert small.records[6].cached_tokens == 0 and small.records[5].status == "ok"
    assert big.summary["sim_pool_loaded_blocks"] == 2  # the last request read its chain


def test_timelines_stay_bounded_however_long_the_run():
    toy = toy_profile()
    from kvpool.sim.cluster import SimCluster

    # every request at time 0 (no span to pace the samples by), then a long decode tail
    reqs = [request(i, 0.0, 10, 400, f"a{i}", f"b{i}") for i in range(5)]
    c = SimCluster(SystemSpec("s", "least_load", prefill=1, decode=1, pool=False),
                   cfg(toy, samples=10), reqs)  # fmt: skip
    c.run()
    assert len(c.timeline) < 20 and c.timeline[-1][0] > 1.0  # it covered the whole run


def test_capacities_follow_the_block_size():
    from kvpool.sim.cluster import SimCluster

    toy = toy_profile()  # 4-token blocks: 100 local blocks, one pool node of 100 blocks
    reqs = [request(0, 0.0, 10, 2, "a")]
    system = SystemSpec("s", "least_load", prefill=1, decode=1, pool=True)
    same = SimCluster(system, SimConfig(toy, 4), reqs)
    assert same.nodes[0].cache.capacity == 100 and same.pool.stats()["pool_capacity_blocks"] == 100
    halves = SimCluster(system, SimConfig(toy, 2), reqs)  # the same bytes in 2-token blocks
    assert halves.nodes[0].cache.capacity == 200
    assert halves.pool.stats()["pool_capacity_blocks"] == 200
    told = SimCluster(system, SimConfig(toy, 2, local_cache_blocks=7, pool_blocks_per_node=9,
                                        pool_nodes=3), reqs)  # fmt: skip
    assert told.nodes[0].cache.capacity == 7 and told.pool.stats()["pool_capacity_blocks"] == 27


def test_a_sustained_prefill_queue_lends_prompts_to_the_decode_node():
    """The conductor's lending rule in the loop: with a prefill queue full for seconds, some
    prompts are computed by the decode node and the work ends sooner; never in a burst."""
    toy = toy_profile()
    load = [request(i, i * 0.05, 40, 2, f"u{i}") for i in range(120)]
    spec = SystemSpec("d", "cache_aware", prefill=1, decode=1, pool=False)
    lend = simulate(spec, cfg(toy, decode_prefill_gain=2.0), load)
    keep = simulate(spec, cfg(toy), load)
    on_decode = [x for x in lend.records if x.prefill_node == x.decode_node]
    assert on_decode and len(on_decode) < len(load)
    assert not [x for x in keep.records if x.prefill_node == x.decode_node]

    def makespan(r):
        return max(x.sent_s + x.end_s for x in r.records)

    assert makespan(lend) < makespan(keep)
    burst = [request(i, 0.0, 40, 2, f"u{i}") for i in range(4)]  # no time to build a backlog
    once = simulate(spec, cfg(toy, decode_prefill_gain=2.0), burst)
    assert all(x.prefill_node == "prefill-0" for x in once.records)

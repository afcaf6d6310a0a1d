"""The event loop and the cluster model on hand-made requests, against hand-computed times."""

from __future__ import annotations

import pytest
from simkit import OVERHEAD, request, step, toy_profile

from kvpool.sim.events import ARRIVAL, FINISH, EventLoop
from kvpool.sim.run import simulate
from kvpool.sim.systems import SimConfig, SystemSpec

EXACT = {"rel": 1e-12, "abs": 1e-15}


def cfg(profile, **kw) -> SimConfig:
    return SimConfig(
        profile, 4, decode_prefill_tokens=0, decode_prefill_gain=0.0, poll_interval=0.0, **kw
    )


def disagg(policy="cache_aware", pool=False, prefill=1, decode=1) -> SystemSpec:
    return SystemSpec("s", policy, prefill=prefill, decode=decode, pool=pool)


def test_event_loop_orders_by_time_priority_then_fifo():
    loop, seen = EventLoop(), []
    loop.at(1.0, seen.append, "arrival", prio=ARRIVAL)
    loop.at(1.0, seen.append, "finish-1", prio=FINISH)
    loop.at(0.5, seen.append, "early")
    loop.at(1.0, seen.append, "finish-2", prio=FINISH)
    assert loop.run(until=0.7) == 0.5 and seen == ["early"]
    loop.run()
    assert seen == ["early", "finish-1", "finish-2", "arrival"] and loop.events == 4
    with pytest.raises(ValueError, match="past"):
        loop.at(0.2, seen.append, "late")


def test_one_request_prefill_transfer_decode():
    toy = toy_profile()
    r = simulate(disagg(), cfg(toy), [request(0, 0.0, 10, 3, "a", "b")])
    rec = r.records[0]
    ttft = step(prefill=10, pairs=55, logits=1)  # 10 tokens, causal pairs 10*11/2
    arrive = ttft + 10 * 8 / 8000 + OVERHEAD  # its KV over the decode node's link
    t2 = arrive + step(logits=1, decodes=1, decode_context=11)
    t3 = t2 + step(logits=1, decodes=1, decode_context=12)
    assert rec.status == "ok" and rec.cached_tokens == 0
    assert rec.token_times == pytest.approx([ttft, t2, t3], **EXACT)
    assert rec.ttft == pytest.approx(ttft, **EXACT) and rec.end_s == pytest.approx(t3, **EXACT)
    assert rec.tbt == pytest.approx(t2 - ttft, **EXACT)  # the longest gap (one of two)
    assert rec.prefill_node == "prefill-0" and rec.decode_node == "decode-0"
    assert r.summary["completed"] == 1 and r.summary["sim_transfers"] == 1


def test_second_turn_reuses_the_local_prefix():
    toy = toy_profile()
    reqs = [request(0, 0.0, 10, 3, "a", "b"), request(1, 1.0, 10, 2, "a", "b")]
    r = simulate(disagg(), cfg(toy), reqs)
    rec = r.records[1]
    ttft = step(prefill=2, pairs=2 * 8 + 3, context=8, logits=1)  # 8 tokens cached
    t2 = ttft + 0.01 + OVERHEAD + step(logits=1, decodes=1, decode_context=11)
    assert rec.cached_tokens == 8 and rec.predicted_hit_tokens == 8
    assert rec.token_times == pytest.approx([ttft, t2], **EXACT)
    assert rec.route_outcome == "as_predicted"
    assert r.summary["prefix_hit_rate"] == pytest.approx(8 / 20)


def test_batching_link_queueing_and_decode_joins():
    toy = toy_profile()
    # a one-token request keeps the prefill node busy while two more arrive
    reqs = [request(0, 0.0, 40, 1, "x"), request(1, 0.001, 10, 3, "a", "b"),
            request(2, 0.001, 10, 3, "c", "d")]  # fmt: skip
    r = simulate(disagg(), cfg(toy), reqs)
    first, a, b = r.records
    t0 = step(prefill=40, pairs=40 * 41 / 2, logits=1)
    assert first.token_times == pytest.approx([t0], **EXACT)
    t = t0 + step(prefill=20, pairs=110, logits=2)  # the next two in one prefill step
    a_at = t + 0.01 + OVERHEAD
    b_at = t + 0.02 + OVERHEAD  # behind a's transfer on the same link
    s1 = step(logits=1, decodes=1, decode_context=11)  # a alone (b arrives during it)
    assert b_at < a_at + s1
    s2 = step(logits=2, decodes=2, decode_context=12 + 11)  # a and b together
    s3 = step(logits=1, decodes=1, decode_context=12)  # b alone
    since = 0.001  # token times count from the arrival
    assert a.token_times == pytest.approx([x - since for x in (t, a_at + s1, a_at + s1 + s2)],
                                          **EXACT)  # fmt: skip
    assert b.token_times == pytest.approx(
        [x - since for x in (t, a_at + s1 + s2, a_at + s1 + s2 + s3)], **EXACT
    )


def test_long_prompt_is_chunked_on_the_prefill_node():
    toy = toy_profile()
    # budget 64 tokens per step: 100 tokens = 64, then 36 after a 64-token context
    r = simulate(disagg(), cfg(toy), [request(0, 0.0, 100, 1, "a")])
    first = step(prefill=64, pairs=64 * 65 / 2, logits=0)
    second = step(prefill=36, pairs=36 * 64 + 36 * 37 / 2, context=64, logits=1)
    rec = r.records[0]
    assert rec.token_times == pytest.approx([first + second], **EXACT)
    assert rec.end_s == rec.ttft and r.summary["sim_transfers"] == 0  # one token: no decode


def test_colocated_without_chunking_stalls_the_decodes():
    toy = toy_profile()
    unchunked = SystemSpec("v", "least_load", colocated=1, chunked=False, pool=False)
    chunked = SystemSpec("c", "least_load", colocated=1, chunked=True, pool=False)
    reqs = [request(0, 0.0, 10, 4, "a", "b"), request(1, 0.02, 10, 2, "c", "d")]
    a = simulate(unchunked, cfg(toy), reqs).records[0]
    t1 = step(prefill=10, pairs=55, logits=1)
    assert t1 > 0.02  # request 1 arrived during a's prefill
    p2 = step(prefill=10, pairs=55, logits=1)  # request 1's prefill alone: a waits
    d1 = step(logits=2, decodes=2, decode_context=11 + 11)  # then both decode
    assert a.token_times[1] == pytest.approx(t1 + p2 + d1, **EXACT)
    c = simulate(chunked, cfg(toy), reqs).records[0]
    # chunked: budget 16 - 1 decode = 15 tokens of request 1 beside a's decode
    mixed = step(prefill=10, pairs=55, logits=2, decodes=1, decode_context=11)
    assert c.token_times[1] == pytest.approx(t1 + mixed, **EXACT)


def test_short_remainder_is_computed_on_the_decode_node():
    toy = toy_profile()
    conf = SimConfig(toy, 4, decode_prefill_tokens=64, poll_interval=0.0)
    r = simulate(disagg(), conf, [request(0, 0.0, 10, 2, "a", "b")])
    rec = r.records[0]
    assert rec.prefill_node == "decode-0" and r.summary["sim_transfers"] == 0
    t1 = step(prefill=10, pairs=55, logits=1)  # no transfer: decode computes and goes on
    assert rec.token_times == pytest.approx(
        [t1, t1 + step(logits=1, decodes=1, decode_context=11)], **EXACT
    )


def test_fast_forwarded_decode_runs_equal_step_by_step_events():
    toy = toy_profile()
    import random

    from kvpool.sim.cluster import SimCluster
    from kvpool.sim.results import records

    rng = random.Random(5)
    reqs, t = [], 0.0
    for i in range(40):
        t += rng.expovariate(8.0)
        blocks = [f"s{rng.randrange(4)}", *(f"r{i}-{j}" for j in range(rng.randrange(1, 6)))]
        reqs.append(request(i, t, 4 * len(blocks) + rng.randrange(1, 4), rng.randrange(1, 40),
                            *blocks))  # fmt: skip
    system = disagg(prefill=2, decode=2, pool=True)

    def run(fast: bool):
        c = SimCluster(system, SimConfig(toy, 4, poll_interval=0.05), reqs)
        c.fast_forward = fast
        c.run()
        return [r.token_times for r in records(c)], [r.prefill_node for r in records(c)], \
            c.loop.events  # fmt: skip

    fast, slow = run(True), run(False)
    assert fast[0] == slow[0] and fast[1] == slow[1]  # the same floats, the same routes
    assert fast[2] < slow[2] * 0.7  # in fewer events


def test_kvpool_decode_worker_computes_the_tail():
    tail = toy_profile(decode_tail=True)
    r = simulate(disagg(), cfg(tail), [request(0, 0.0, 10, 4, "a", "b")])
    rec = r.records[0]
    t1 = step(prefill=10, pairs=55, logits=1)
    arrive = t1 + 8 * 8 / 8000 + OVERHEAD  # only the two full blocks travel
    t2 = arrive + step(prefill=2, pairs=2 * 8 + 3, context=8, logits=1)  # the tail: token 2
    t3 = t2 + step(logits=1, decodes=1, decode_context=12)  # then decoding from 12 tokens
    t4 = t3 + step(logits=1, decodes=1, decode_context=13)
    assert rec.token_times == pytest.approx([t1, t2, t3, t4], **EXACT)
    assert rec.prefill_node == "prefill-0" and r.summary["sim_transfer_bytes"] == 64
    two = simulate(disagg(), cfg(tail), [request(0, 0.0, 10, 2, "a", "b")]).records[0]
    assert two.token_times == pytest.approx([t1, t2], **EXACT)  # no decode step at all


def test_nodes_on_one_host_share_its_cores():
    from kvpool.sim.host import SharedHost

    loop, ends = EventLoop(), {}

    def done(name: str) -> None:
        ends[name] = loop.now

    host = SharedHost(loop, cores=1, threads=1)
    loop.at(0.0, host.run, "a", 1.0, done, "a")
    loop.at(0.5, host.run, "b", 1.0, done, "b")
    loop.run()
    # a alone until 0.5, then both at half speed: a's last 0.5 s of work ends at 1.5; b has
    # done 0.5 by then and finishes alone at 2.0 (moved end events left stale copies)
    assert ends == pytest.approx({"a": 1.5, "b": 2.0}, **EXACT)
    loop, ends = EventLoop(), {}
    two = SharedHost(loop, cores=2, threads=1)  # as many cores as steps: no slowdown
    loop.at(0.0, two.run, "a", 1.0, done, "a")
    loop.at(0.0, two.run, "b", 1.0, done, "b")
    loop.run()
    assert ends == pytest.approx({"a": 1.0, "b": 1.0}, **EXACT)


def test_a_new_step_never_ends_on_an_earlier_steps_stale_event():
    """A moved end event leaves a stale copy behind; a node's next step must never be ended by
    its previous step's stale copy (it was when each step counted its versions from zero)."""
    from kvpool.sim.host import SharedHost

    loop, ends = EventLoop(), {}
    host = SharedHost(loop, cores=1, threads=1)

    def done(which: str) -> None:
        ends[which] = loop.now
        if which == "a1":
            host.run("a", 4.0, done, "a2")

    loop.at(0.0, host.run, "a", 1.0, done, "a1")  # a1's end: 1.0 alone
    loop.at(0.0, host.run, "b", 0.5, done, "b1")  # a1's end moves to 2.0 (a stale copy stays)
    loop.at(1.6, host.run, "b", 1.0, done, "b2")  # a2 (from 1.5) is moved once: as often
    loop.run()
    # a1 ends at 1.5 (b1 took half the core until 1.0); the core never idles from then on, so
    # a2 ends when all 6.5 s of work is done, not at 2.0 on a1's stale copy
    assert ends == pytest.approx({"b1": 1.0, "a1": 1.5, "b2": 3.6, "a2": 6.5}, **EXACT)


def test_a_shared_host_slows_overlapping_prefills():
    alone = toy_profile()
    shared = toy_profile(host_cores=1)
    reqs = [request(0, 0.0, 10, 1, "a"), request(1, 0.0, 10, 1, "b")]
    system = disagg(policy="round_robin", prefill=2)
    t = step(prefill=10, pairs=55, logits=1)
    free = [r.ttft for r in simulate(system, cfg(alone), reqs).records]
    assert free == pytest.approx([t, t], **EXACT)  # two nodes, in parallel
    both = [r.ttft for r in simulate(system, cfg(shared), reqs).records]
    assert both == pytest.approx([2 * t, 2 * t], **EXACT)  # two nodes on one core


def test_prefill_nodes_run_prompts_in_chunks_of_their_own_budget():
    """``prefill_chunk_tokens`` (kvpool serve's --prefill-chunk): a prefill node computes at
    most that many prompt tokens per step, each chunk after the KV of those before it; two
    prompts arriving together are computed one after the other, not in one step."""
    chunked = toy_profile(prefill_chunk_tokens=4)
    rec = simulate(disagg(), cfg(chunked), [request(0, 0.0, 10, 1, "a", "b")]).records[0]
    t = step(prefill=4, pairs=causal(4, 0), logits=0)
    t += step(prefill=4, pairs=causal(4, 4), context=4, logits=0)
    t += step(prefill=2, pairs=causal(2, 8), context=8, logits=1)
    assert rec.ttft == pytest.approx(t, **EXACT)
    three = [request(i, 0.0, 4, 1, name) for i, name in enumerate("abc")]
    first = step(prefill=4, pairs=causal(4, 0), logits=1)
    ttfts = [r.ttft for r in simulate(disagg(), cfg(toy_profile(prefill_chunk_tokens=4)),
                                      three).records]  # fmt: skip
    assert ttfts == pytest.approx([first, 2 * first, 3 * first], **EXACT)
    # without it the first starts alone and the two behind it share the next step
    batched = [r.ttft for r in simulate(disagg(), cfg(toy_profile()), three).records]
    both = first + step(prefill=8, pairs=2 * causal(4, 0), logits=2)
    assert batched == pytest.approx([first, both, both], **EXACT)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        toy_profile(prefill_chunk_tokens=0)


def causal(new: int, context: int) -> float:
    return new * context + new * (new + 1) / 2

"""Routing policies and admission as pure functions of made-up cluster snapshots."""

from __future__ import annotations

import pytest

from kvpool.common.errors import RejectedError, UnavailableError
from kvpool.conductor.cluster_state import (
    ClusterSnapshot,
    CostModel,
    RequestInfo,
    WorkerLoad,
    WorkerView,
)
from kvpool.conductor.policies import get_policy, predicted_tbt, predicted_ttft
from kvpool.conductor.router import LEND_BACKLOG, Router, SLOConfig

COST = CostModel(prefill_base_s=0.01, prefill_token_s=0.001, decode_base_s=0.02,
                 decode_seq_s=0.005)  # fmt: skip
HASHES = tuple(bytes([i]) * 16 for i in range(8))  # an 8-block chain
BLOCK_BYTES = 1 << 20


def worker(wid, role="prefill", cached=0, queued=0, running=0, remaining=(), inflight=0,
           backlogged=0.0, step_tokens=0):  # fmt: skip
    load = WorkerLoad(queued, running, 0, 0.0, list(remaining), inflight, backlogged)
    return WorkerView(wid, role, f"h:{wid}", f"r:{wid}", load, COST, set(HASHES[:cached]),
                      step_tokens=step_tokens)  # fmt: skip


def req(blocks=8, pool=0, tokens=None):
    n = tokens if tokens is not None else blocks * 16 + 5
    return RequestInfo(n, HASHES[:blocks], 16, 32, pool)


def snap(*workers, pool_up=True, bw=1e9):
    return ClusterSnapshot(list(workers), pool_bytes_per_s=bw, block_bytes=BLOCK_BYTES,
                           pool_up=pool_up)  # fmt: skip


def test_ttft_counts_queue_uncached_tokens_and_pool_transfer():
    w = worker("a", cached=2, queued=100)
    p = predicted_ttft(snap(w), w, req(pool=6))
    # queue: 0.01 + 0.1; compute: 133 - 96 = 37 tokens; transfer: 4 blocks of 1 MiB at 1 GB/s
    assert p.local_blocks == 2 and p.pool_blocks == 4
    assert p.predicted_s == pytest.approx(0.11 + (0.01 + 0.037) + 4 * BLOCK_BYTES / 1e9)
    down = predicted_ttft(snap(w, pool_up=False), w, req(pool=6))
    assert down.pool_blocks == 0 and down.predicted_s == pytest.approx(0.11 + 0.01 + 0.101)


def test_cache_aware_prefers_the_holder_of_the_prefix():
    holder, other = worker("a", cached=8), worker("b")
    assert get_policy("cache_aware").choose_prefill(snap(holder, other), req()).worker_id == "a"
    # without the pool the other worker would recompute everything: still the holder
    got = get_policy("cache_aware").choose_prefill(snap(holder, other, pool_up=False), req())
    assert got.worker_id == "a"


def test_cache_aware_replicates_a_hot_prefix_beyond_the_threshold():
    policy = get_policy("cache_aware", balancing_threshold=0.25)
    other = worker("b")
    slightly_busy = worker("a", cached=8, queued=2)  # 0.027 s vs b: 0.023 s (8 MiB to load)
    assert policy.choose_prefill(snap(slightly_busy, other), req(pool=8)).worker_id == "a"
    hot = worker(
        "a", cached=8, queued=100
    )  # 0.125 s; b: 0.023 s pulling 8 blocks, 0.143 s recomputing
    got = policy.choose_prefill(snap(hot, other), req(pool=8))
    assert got.worker_id == "b" and got.pool_blocks == 8
    # if the pool does not have it, b would recompute: the hot holder may still win
    assert policy.choose_prefill(snap(hot, other), req(pool=0)).worker_id == "a"


def test_cache_aware_ignores_dead_and_decode_workers():
    dead = worker("a", cached=8)
    dead.alive = False
    dec = worker("d", role="decode", cached=8)
    got = get_policy("cache_aware").choose_prefill(snap(dead, dec, worker("b")), req())
    assert got.worker_id == "b"
    assert get_policy("cache_aware").choose_prefill(snap(dead, dec), req()) is None


def test_local_cache_aware_counts_only_each_workers_own_cache():
    policy = get_policy("local")
    holder, other = worker("a", cached=8), worker("b")
    got = policy.choose_prefill(snap(holder, other), req(pool=8))
    assert got.worker_id == "a" and got.local_blocks == 8 and got.pool_blocks == 0
    # the pool holds the whole prefix, but local never plans a load: a busy holder still
    # beats recomputing 133 tokens elsewhere (cache_aware would pull it from the pool)
    hot = worker("a", cached=8, queued=100)  # 0.11 s queue + 0.015 s vs 0.143 s from scratch
    got = policy.choose_prefill(snap(hot, other), req(pool=8))
    assert got.worker_id == "a" and got.pool_blocks == 0
    assert get_policy("cache_aware").choose_prefill(snap(hot, other), req(pool=8)).worker_id == "b"
    # when the holder's queue costs more than its prefix saves, the least loaded one wins
    hotter = worker("a", cached=8, queued=200)
    got = policy.choose_prefill(snap(hotter, other), req(pool=8))
    assert got.worker_id == "b" and got.local_blocks == 0
    assert got.predicted_s == pytest.approx(COST.prefill_s(133))
    # a longer local prefix wins over a shorter one on equal queues; ties go to the first id
    assert policy.choose_prefill(snap(worker("b", cached=2), worker("c", cached=5)),
                                 req()).worker_id == "c"  # fmt: skip
    assert policy.choose_prefill(snap(worker("b"), worker("a")), req()).worker_id == "a"


def test_local_policy_is_registered_and_ignores_dead_and_decode_workers():
    dead = worker("a", cached=8)
    dead.alive = False
    dec = worker("d", role="decode", cached=8)
    assert get_policy("local").name == "local"
    assert get_policy("local").choose_prefill(snap(dead, dec, worker("b")), req()).worker_id == "b"
    assert get_policy("local").choose_prefill(snap(dead, dec), req()) is None
    route = Router(get_policy("local"), SLOConfig(ttft_s=None, tbt_s=None)).route(
        snap(worker("p", cached=8), worker("d", role="decode")), req(), 0
    )
    assert route.prefill.worker_id == "p" and route.decode.worker_id == "d"


def test_round_robin_random_and_least_load():
    ws = [worker("a", queued=50), worker("b", queued=10), worker("c", queued=30)]
    rr = get_policy("round_robin")
    assert [rr.choose_prefill(snap(*ws), req()).worker_id for _ in range(4)] == list("abca")
    assert get_policy("least_load").choose_prefill(snap(*ws), req()).worker_id == "b"
    picks = {get_policy("random", seed=s).choose_prefill(snap(*ws), req()).worker_id
             for s in range(20)}  # fmt: skip
    assert picks == {"a", "b", "c"}
    r1, r2 = get_policy("random", seed=7), get_policy("random", seed=7)
    assert [r1.choose_prefill(snap(*ws), req()).worker_id for _ in range(5)] == \
        [r2.choose_prefill(snap(*ws), req()).worker_id for _ in range(5)]  # fmt: skip
    with pytest.raises(ValueError, match="unknown routing policy"):
        get_policy("fastest")


def test_tbt_is_predicted_at_arrival_time():
    # 4 running: two finish within 0.1 s (2 tokens left at ~0.04 s/step), two run long
    w = worker("d", role="decode", running=4, remaining=[2, 2, 100, 100])
    now = predicted_tbt(w, 0.0)
    later = predicted_tbt(w, 1.0)
    assert now == pytest.approx(COST.decode_step_s(5))
    assert later == pytest.approx(COST.decode_step_s(3))
    routed = worker("d", role="decode", running=0, inflight=3)  # already sent its way
    assert predicted_tbt(routed, 0.5) == pytest.approx(COST.decode_step_s(4))


def test_decode_choice_keeps_tbt_lowest():
    busy = worker("d1", role="decode", running=20, remaining=[500] * 20)
    idle = worker("d2", role="decode")
    got = get_policy("cache_aware").choose_decode(snap(busy, idle), req(), 0.5)
    assert got.worker_id == "d2"


def test_router_disaggregated_colocated_and_fallbacks():
    r = Router(get_policy("cache_aware"), SLOConfig(ttft_s=None, tbt_s=None))
    route = r.route(snap(worker("p"), worker("d", role="decode")), req(), 0)
    assert route.prefill.worker_id == "p" and route.decode.worker_id == "d"
    both = r.route(snap(worker("x", role="both")), req(), 0)
    assert both.prefill is None and both.decode.worker_id == "x"
    only_decode = r.route(snap(worker("d", role="decode")), req(), 0)
    assert only_decode.prefill is None and only_decode.decode.worker_id == "d"
    only_prefill = r.route(snap(worker("p")), req(), 0)  # every decode worker died
    assert only_prefill.prefill is None and only_prefill.decode.worker_id == "p"
    with pytest.raises(UnavailableError):
        r.route(snap(), req(), 0)


def test_admission_rejects_by_reason():
    ws = snap(worker("p", queued=5000), worker("d", role="decode", running=50))
    with pytest.raises(RejectedError) as e:
        Router(get_policy("least_load"), SLOConfig(ttft_s=1.0, tbt_s=None)).route(ws, req(), 0)
    assert e.value.reason == "ttft_slo" and e.value.retry_after >= 1 and e.value.http_status == 429
    with pytest.raises(RejectedError) as e:
        Router(get_policy("least_load"), SLOConfig(ttft_s=None, tbt_s=0.1)).route(ws, req(), 0)
    assert e.value.reason == "tbt_slo"
    with pytest.raises(RejectedError) as e:
        Router(get_policy("least_load"), SLOConfig(max_inflight=3)).route(ws, req(), 3)
    assert e.value.reason == "queue_full"
    ok = Router(get_policy("least_load"), SLOConfig(ttft_s=10.0, tbt_s=0.5)).route(ws, req(), 0)
    assert ok.predicted_ttft_s < 10 and ok.predicted_tbt_s < 0.5
    with pytest.raises(ValueError):
        SLOConfig(ttft_s=-1)


def test_short_remainders_skip_the_prefill_hand_off():
    ws = snap(worker("p"), worker("d", role="decode"))
    nearly_cached = req(blocks=8, pool=8)  # 133 tokens, 128 in the pool: 5 left to compute
    slo = SLOConfig(ttft_s=None, tbt_s=None)
    direct = Router(get_policy("cache_aware"), slo, decode_prefill_tokens=64).route(
        ws, nearly_cached, 0
    )
    assert direct.prefill is None and direct.decode.worker_id == "d"
    cold = Router(get_policy("cache_aware"), slo, decode_prefill_tokens=64).route(ws, req(), 0)
    assert cold.prefill is not None  # 133 tokens to compute: hand off
    always = Router(get_policy("cache_aware"), slo, decode_prefill_tokens=0).route(
        ws, nearly_cached, 0
    )
    assert always.prefill is not None
    # a decode worker stepping 16 streams would start the remainder a step later than the
    # idle prefill worker: the prefill worker takes it (the decode batch keeps its pace)
    busy = snap(worker("p"), worker("d", role="decode", running=16))
    handed = Router(get_policy("cache_aware"), slo, decode_prefill_tokens=64).route(
        busy, nearly_cached, 0
    )
    assert handed.prefill is not None and handed.prefill.worker_id == "p"
    # with streams running, its step would be a gap in each: handed off even when the prefill
    # worker's queue makes the TTFT later, unless that breaks the TTFT SLO and keeping it
    # does not
    queued = snap(worker("p", queued=100), worker("d", role="decode", running=2))
    router = Router(get_policy("cache_aware"), slo, decode_prefill_tokens=64)
    assert router.route(queued, nearly_cached, 0).prefill is not None
    swamped = snap(worker("p", queued=5000), worker("d", role="decode", running=2))
    assert router.route(swamped, nearly_cached, 0).prefill is not None  # no SLO to break
    with_slo = Router(get_policy("cache_aware"), SLOConfig(ttft_s=1.0, tbt_s=None),
                      decode_prefill_tokens=64)  # fmt: skip
    assert with_slo.route(swamped, nearly_cached, 0).prefill is None  # 5 s there: kept
    assert with_slo.route(queued, nearly_cached, 0).prefill is not None
    with pytest.raises(ValueError):
        Router(get_policy("cache_aware"), slo, decode_prefill_tokens=-1)


def test_a_decode_worker_is_lent_whole_prompts_when_the_prefill_queue_is_far_behind():
    slo = SLOConfig(ttft_s=None, tbt_s=None)
    lend = Router(get_policy("cache_aware"), slo, decode_prefill_gain=2.0)
    cold = req()  # 133 tokens to compute: 0.143 s on either worker

    def prefill(queued, backlogged=1.0):
        return worker("p", queued=queued, backlogged=backlogged)

    both_idle = snap(prefill(0, 0.0), worker("d", role="decode"))
    r = lend.route(both_idle, cold, 0)  # no gain: disaggregation as usual
    assert r.prefill is not None and r.decode_prompt_tokens == 0 and r.on_decode == ""
    # 1,000 tokens queued on the prefill worker, for a while: 1.153 s there, 0.143 s on the
    # idle decode worker
    behind = snap(prefill(1000), worker("d", role="decode"))
    r = lend.route(behind, cold, 0)
    assert r.prefill is None and r.decode.worker_id == "d" and r.on_decode == "lent"
    assert r.decode_prompt_tokens == 133 and r.predicted_ttft_s == pytest.approx(0.143)
    # the same queue just after a burst (its queue empty most of the last seconds): handed off
    burst = snap(prefill(1000, backlogged=LEND_BACKLOG - 0.05), worker("d", role="decode"))
    assert lend.route(burst, cold, 0).prefill is not None
    # four running streams: each waits 0.143 s once (0.572 s in all, half of it counted) for
    # a 0.97 s gain: lent
    four = snap(prefill(1000), worker("d", role="decode", running=4))
    assert lend.route(four, cold, 0).on_decode == "lent"
    # sixteen: 2.288 s of delays (1.144 s counted) for a 0.91 s gain: handed off
    sixteen = snap(prefill(1000), worker("d", role="decode", running=16))
    assert lend.route(sixteen, cold, 0).prefill is not None
    # the decode worker's own queue counts: 1,000 tokens there too, no gain
    queued = snap(prefill(1000), worker("d", role="decode", queued=1000))
    assert lend.route(queued, cold, 0).prefill is not None
    # less than the required factor: 0.3 s there against 0.143 s (2.1x) is lent at 2, not at 3
    near = snap(prefill(147), worker("d", role="decode"))
    assert lend.route(near, cold, 0).on_decode == "lent"
    strict = Router(get_policy("cache_aware"), slo, decode_prefill_gain=3.0)
    assert strict.route(near, cold, 0).prefill is not None
    # a prompt step longer than the TBT SLO would break it for the running streams
    tight = Router(get_policy("cache_aware"), SLOConfig(ttft_s=None, tbt_s=0.15),
                   decode_prefill_gain=2.0)  # fmt: skip
    assert tight.route(four, cold, 0).prefill is not None
    # unless its steps hold 64 tokens: 60 of the prompt and 4 decodes, 0.11 s a step
    chunked = snap(prefill(1000), worker("d", role="decode", running=4, step_tokens=64))
    assert tight.route(chunked, cold, 0).on_decode == "lent"
    assert tight.route(behind, cold, 0).on_decode == "lent"  # nothing running: no gap
    never = Router(get_policy("cache_aware"), slo, decode_prefill_gain=0.0)
    assert never.route(behind, cold, 0).prefill is not None
    for bad in (0.5, -1.0, float("nan")):
        with pytest.raises(ValueError):
            Router(get_policy("cache_aware"), slo, decode_prefill_gain=bad)


def test_the_route_says_how_many_prompt_tokens_its_decode_side_computes():
    slo = SLOConfig(ttft_s=None, tbt_s=None)
    router = Router(get_policy("cache_aware"), slo, decode_prefill_tokens=64)
    r = router.route(snap(worker("p"), worker("d", role="decode")), req(blocks=8, pool=8), 0)
    assert r.on_decode == "remainder" and r.decode_prompt_tokens == 5
    colocated = router.route(snap(worker("a", role="both", cached=2)), req(), 0)
    assert colocated.prefill is None and colocated.on_decode == ""
    assert colocated.decode_prompt_tokens == 133 - 32
    alone = router.route(snap(worker("d", role="decode")), req(), 0)  # no prefill worker alive
    assert alone.on_decode == "no_prefill" and alone.decode_prompt_tokens == 133


def test_ties_are_broken_by_id_with_numbers_by_value():
    from kvpool.conductor.policies.base import by_id

    ws = [worker(f"prefill-{i}") for i in (10, 2, 1)]
    assert [w.id for w in by_id(ws)] == ["prefill-1", "prefill-2", "prefill-10"]
    assert get_policy("cache_aware").choose_prefill(snap(*ws), req()).worker_id == "prefill-1"
    dec = [worker(f"decode-{i}", role="decode") for i in (10, 9)]
    got = get_policy("least_load").choose_decode(snap(*dec), req(), 0.0)
    assert got.worker_id == "decode-9"


def test_ttft_of_a_colocated_worker_counts_its_running_decodes():
    idle, busy = worker("a", role="both"), worker("b", role="both", running=8)
    r = req(blocks=0, tokens=100)
    assert predicted_ttft(snap(idle), idle, r).predicted_s == pytest.approx(0.01 + 0.1)
    # its first prefill chunk shares a step with 8 decodes: 0.02 + 8 x 0.005 more
    assert predicted_ttft(snap(busy), busy, r).predicted_s == pytest.approx(0.11 + 0.06)
    prefill_only = worker("c", running=8)  # a prefill worker's decodes are not in its steps
    assert predicted_ttft(snap(prefill_only), prefill_only, r).predicted_s == pytest.approx(0.11)
    assert get_policy("cache_aware").choose_prefill(snap(busy, idle), r).worker_id == "a"

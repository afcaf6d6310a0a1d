"""The conductor's poller against real RPC servers standing in for workers (a unit-test seam;
the real workers are in tests/integration/e2e)."""

from __future__ import annotations

import math
import time

import pytest

from kvpool.common.rpc import RpcServer
from kvpool.conductor.cluster import ClusterState
from kvpool.conductor.cluster_state import BACKLOG_WINDOW_S, decay_backlog
from kvpool.engine.block_pool import MAX_EVENTS, BlockPool
from kvpool.engine.step_model import StepModel


class FakeWorker:
    """Answers ``status`` like a worker whose cache is ``pool``."""

    def __init__(self, wid: str, role: str) -> None:
        self.pool = BlockPool(64)
        self.wid, self.role = wid, role
        self.calls: list[int] = []

    def status(self, since: int = 0) -> dict:
        self.calls.append(since)
        out = {"id": self.wid, "role": self.role, "http": "127.0.0.1:1", "rpc": "", "pid": 1,
               "alive": True, "namespace": "ns", "block_size": 16, "block_bytes": 1024,
               "model": "m", "max_model_len": 2048, "vocab_size": 100,
               "load": {"queued_prefill_tokens": 5, "running": 1, "waiting": 0, "kv_usage": 0.1,
                        "remaining_tokens": [3]},
               "cost": {"prefill_token_s": 0.01}, "counters": {}}  # fmt: skip
        events = self.pool.events_since(since)
        if events is None or since <= 0:
            out["snapshot"] = [h.hex() for h in self.pool.cached_hashes()]
            out["events"] = []
        else:
            out["events"] = [[e.seq, e.kind, e.block_hash.hex()] for e in events]
        out["event_seq"] = self.pool.event_seq
        return out


def cache(pool: BlockPool, tag: int) -> bytes:
    [block] = pool.allocate(1)
    h = bytes([tag]) * 16
    assert pool.cache_block(block, h, (tag,))
    pool.free([block])
    return h


@pytest.fixture
def worker():
    fake = FakeWorker("w1", "prefill")
    with RpcServer({"status": fake.status}) as srv:
        yield fake, srv


def test_events_keep_the_conductor_view_of_a_cache_exact(worker):
    fake, srv = worker
    first = cache(fake.pool, 1)
    cluster = ClusterState([srv.address], poll_interval=60)
    cluster.poll_once()
    [view] = cluster.snapshot().workers
    assert view.cached == {first} and fake.calls == [0]  # a snapshot first
    assert view.load.queued_prefill_tokens == 5 and view.cost.prefill_token_s == 0.01
    second = cache(fake.pool, 2)
    fake.pool.allocate(fake.pool.num_free_blocks)  # reuses (evicts) both cached blocks
    cluster.poll_once()
    assert fake.calls[-1] > 0  # then only events
    assert cluster.snapshot().workers[0].cached == set()
    assert second not in cluster.snapshot().workers[0].cached
    assert cluster.namespace == "ns" and cluster.block_size == 16
    cluster.close()


def test_prefills_routed_since_the_last_poll_count_as_queue(worker):
    """A burst arrives between two polls: what the conductor itself sent counts as queued
    (else every request of the burst sees the empty queue of the last report)."""
    _, srv = worker
    cluster = ClusterState([srv.address], poll_interval=60)
    cluster.poll_once()
    w = cluster.worker("w1")
    assert cluster.snapshot().workers[0].load.queued_prefill_tokens == 5  # as reported
    w.pending_tokens += 900
    assert cluster.snapshot().workers[0].load.queued_prefill_tokens == 900
    w.pending_tokens -= 900
    assert cluster.snapshot().workers[0].load.queued_prefill_tokens == 5
    cluster.close()


def test_backlogged_is_the_recent_share_of_time_with_a_queue(worker):
    _, srv = worker  # it always reports 5 queued prompt tokens
    cluster = ClusterState([srv.address], poll_interval=60)
    cluster.poll_once()
    first = cluster.snapshot().workers[0].load.backlogged
    time.sleep(0.3)
    later = cluster.snapshot().workers[0].load.backlogged
    assert 0 <= first < later < 1
    cluster.close()
    assert decay_backlog(0.0, True, 0.0) == 0.0
    full = decay_backlog(0.0, True, BACKLOG_WINDOW_S)  # one time constant of queue
    assert full == pytest.approx(1 - math.exp(-1))
    assert decay_backlog(0.0, True, 10 * BACKLOG_WINDOW_S) > 0.99
    assert decay_backlog(full, False, BACKLOG_WINDOW_S) == pytest.approx(full * math.exp(-1))
    assert decay_backlog(0.5, True, -1.0) == 0.5  # a clock step back changes nothing


def test_too_many_events_fall_back_to_a_snapshot():
    pool = BlockPool(8)
    for i in range(MAX_EVENTS // 2 + 10):  # stored + removed per turn
        cache(pool, i % 250)
        pool.reset_cache()
    assert pool.events_since(1) is None
    assert pool.events_since(pool.event_seq) == []
    assert [e.kind for e in pool.events_since(pool.event_seq - 2)] == ["stored", "removed"]


def test_a_silent_worker_is_dropped_within_seconds(worker):
    _, srv = worker
    cluster = ClusterState([srv.address], poll_interval=0.1, dead_after=0.5).start()
    assert cluster.snapshot().workers[0].alive
    srv.close()
    deadline = time.monotonic() + 5
    while cluster.snapshot().workers[0].alive:
        assert time.monotonic() < deadline, "still alive"
        time.sleep(0.05)
    doc = cluster.describe()
    assert doc["workers"][0]["alive"] is False and doc["store"] is None
    cluster.close()


def test_step_model_fits_measured_steps():
    m = StepModel()
    assert m.fit() == m.prior  # too few samples
    for i in range(60):
        prefill = (0, 16, 64, 256)[i % 4]
        decodes = i % 7
        m.observe(prefill, decodes, 0.01 + 0.002 * prefill + 0.004 * decodes)
    fit = m.fit()
    assert fit.prefill_base_s == pytest.approx(0.01, rel=1e-3)
    assert fit.prefill_token_s == pytest.approx(0.002, rel=1e-3)
    assert fit.decode_seq_s == pytest.approx(0.004, rel=1e-3)
    same = StepModel()
    for _ in range(20):
        same.observe(0, 1, 0.05)  # one shape only: the prior's slopes are kept
    assert same.fit().prefill_token_s == same.prior.prefill_token_s


def test_step_costs_leave_the_prior_as_soon_as_there_are_enough_samples():
    """A new engine's first load-or-recompute decisions use its measured steps, not the prior
    (refitting only every REFIT_STEPS steps kept a decode step of the prior's 32 ms for the
    first 32 steps where this machine takes 9)."""
    from collections import deque

    from kvpool.engine.step_model import MIN_SAMPLES, StepCosts

    samples: deque = deque(maxlen=512)
    costs = StepCosts(samples, steps=lambda: len(samples), running=lambda: 1)
    assert costs.step_s() == costs.model.prior.decode_step_s(1)  # nothing measured yet
    for i in range(MIN_SAMPLES):
        samples.append((0, 1 + i % 3, 0.005 + 0.002 * (1 + i % 3)))  # decode steps
        samples.append((16 * (1 + i % 4), 1, 0.01 + 0.002 + 0.001 * 16 * (1 + i % 4)))
    assert costs.step_s() == pytest.approx(0.007, rel=1e-3)  # 2 * MIN_SAMPLES steps < 32
    # 1 ms a token; the prior's 32 ms decode step, subtracted from these steps, gave 0.015
    assert costs.prefill_s(32) == pytest.approx(0.032, rel=0.15)


def test_step_costs_count_a_prompt_step_s_fixed_cost():
    """A short prompt's recompute is what its step costs beyond a decode step: one measured
    step of about that length is used as it is, and without one the fitted line's extra fixed
    cost of a step with prompt rows is added to its slope (the slope alone made a 32-token
    recompute look cheaper than a load that was faster)."""
    from collections import deque

    from kvpool.engine.step_model import StepCosts

    samples: deque = deque(maxlen=512)
    costs = StepCosts(samples, steps=lambda: len(samples), running=lambda: 1)
    for i in range(8):
        samples.append((0, 1, 0.010))  # decode steps: 10 ms
        samples.append((256 * (1 + i % 2), 1, 0.010 + 0.020 + 0.001 * 256 * (1 + i % 2)))
    # no step near 32 tokens: the line's 20 ms of prompt-step overhead plus 1 ms a token
    assert costs.prefill_s(32) == pytest.approx(0.020 + 0.032, rel=0.05)
    samples.append((33, 1, 0.010 + 0.060))  # one step of 33 tokens took 60 ms more
    costs.fit = costs.model.prior  # refit now
    assert costs.prefill_s(32) == pytest.approx(0.060 * 32 / 33, rel=0.05)


def test_step_model_is_not_fooled_by_noise_over_one_prompt_length():
    """Prefills of 262..270 tokens whose times wobble with machine load (the longer ones
    happened to run alone): the least-squares line slopes down and its intercept is seconds.
    The fit must still predict about what such a prefill costs, not reject everything."""
    m = StepModel()
    for i in range(40):
        m.observe(0, 2, 0.05)  # decode steps: the base
        tokens = 262 + i % 9
        m.observe(tokens, 0, 0.9 - 0.05 * (tokens - 262) + 0.02 * (i % 2))
    fit = m.fit()
    mean_s = sum(0.9 - 0.05 * (262 + i % 9 - 262) + 0.02 * (i % 2) for i in range(40)) / 40
    assert fit.prefill_token_s > 0
    assert fit.prefill_base_s < 0.1
    assert fit.prefill_s(266) == pytest.approx(mean_s, rel=0.1)


def test_snapshots_are_copies_the_poller_never_changes():
    from kvpool.conductor.cluster import ClusterState, _Worker
    from kvpool.conductor.cluster_state import WorkerLoad, WorkerView

    cs = ClusterState([])
    w = _Worker(rpc=None)
    w.cached = frozenset({b"a"})
    w.view = WorkerView("w1", "decode", "h:1", "h:2", WorkerLoad(running=1), cached=w.cached)
    cs._workers["h:2"] = w
    w.last_ok = time.monotonic()
    snap = cs.snapshot()
    view = snap.workers[0]
    # what the poller does with the next status: new load, new cached set, an event applied
    w.inflight = 7
    w.view.load.running = 5
    w.cached = frozenset({b"a", b"b"})
    assert view.load.running == 1 and view.load.inflight == 0 and view.cached == {b"a"}
    view.load.running = 99  # a policy scribbling on its copy changes nothing live
    assert w.view.load.running == 5
    later = cs.snapshot().workers[0]
    assert later.load.inflight == 7 and later is not view


def test_a_worker_with_a_malformed_status_is_not_routed_to(worker):
    fake, srv = worker
    good = fake.status
    with RpcServer({"status": lambda since=0: {**good(since), "block_size": "sixteen"}}) as bad:
        cluster = ClusterState([srv.address, bad.address], poll_interval=60)
        cluster.poll_once()
        assert [v.id for v in cluster.snapshot().workers] == ["w1"]  # the other is ignored
        assert cluster.worker("w1") is not None
        cluster.close()

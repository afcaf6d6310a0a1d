"""Asynchronous prefix loads: a request waits for its KV in its own state while others step;
failed, short, late or abandoned loads cost recompute only, never a wrong token or a leak.

The seam here is a dict-backed connector whose loads run on a thread behind a gate the test
opens; tests/serving/test_store_connector.py runs the same path on the real pool."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from test_connector import DictConnector, generate_one

from kvpool import SamplingParams
from kvpool.engine.request import RequestStatus
from kvpool.model.kernels import kernels


class GatedConnector(DictConnector):
    """Loads in the background, each after ``gate`` opens; ``fail_after``: blocks past it come
    back missing; ``max_loads``: loads in flight at once (more: "ask again later")."""

    def __init__(self, store, fail_after=None, max_loads=8):
        super().__init__(store)
        self.gate = threading.Event()
        self.fail_after = fail_after
        self.max_loads = max_loads
        self.inflight = 0
        self.peak = 0
        self.finished: dict[str, int] = {}
        self.cancelled: list[str] = []
        self.started: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if n and self.inflight >= self.max_loads:
            return None, True
        return n, n > 0

    def update_state_after_alloc(self, request, blocks, block_ids):
        rid = request.request_id
        self.started.append(rid)
        with self._lock:
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)

        def work():
            self.gate.wait(30)
            keep = blocks if self.fail_after is None else blocks[: self.fail_after]
            n = self.load(keep, block_ids[: len(keep)])
            with self._lock:
                self.finished[rid] = n
                self.inflight -= 1

        t = threading.Thread(target=work)
        t.start()
        self._threads.append(t)

    def request_finished(self, request_id):
        self.cancelled.append(request_id)

    def get_finished(self):
        with self._lock:
            out, self.finished = self.finished, {}
        return out


def prompt_of(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
kern = kernels()  # the engines' kernel module (None where it cannot be built)


@pytest.fixture
def warm_store(tiny_engine_factory):
    """A store holding the blocks of one 41-token prompt, and its cold output."""
    conn = DictConnector()
    eng = tiny_engine_factory(connector=conn)
    prompt = prompt_of(11, 41)
    cold = generate_one(eng, prompt, SP).outputs[0].token_ids
    eng.close()
    return conn.store, prompt, cold


def settled_usage(eng):
    """Pool usage once every save has been given back."""
    eng.connector.close()
    eng._release_saved()
    return eng.pool.usage()


def step_until(eng, cond, limit=10.0):
    """Step until ``cond()`` (at most ``limit`` seconds); the last output of each request."""
    outs = {}
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return outs
        for o in eng.step():
            outs[o.request_id] = o
    raise AssertionError("condition not reached")


def test_other_requests_decode_while_a_prefix_loads(warm_store, tiny_engine_factory,
                                                   two_threads):  # fmt: skip
    store, prompt, cold = warm_store
    conn = GatedConnector(store)
    eng = tiny_engine_factory(connector=conn)
    eng.add_request("other", prompt_of(12, 9), SamplingParams(temperature=0, max_tokens=20,
                                                              ignore_eos=True))  # fmt: skip
    eng.add_request("loads", prompt, SP)
    step_until(eng, lambda: conn.started)
    req = eng.requests["loads"]
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    status = eng.status  # what the engine published after that step (the control RPC reads it)
    assert (status.running, status.waiting, status.loading) == (1, 1, 1)
    assert status.queued_prefill_tokens == 41 - 0  # the loading prompt, nothing computed yet
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.running = 5
    other = eng.requests["other"]
    before = len(other.output_token_ids)
    for _ in range(5):
        eng.step()  # the gate is shut: only "other" can advance
        # a load in flight: the kernels let the load thread run during the step, on a core
        # the step leaves it
        assert kern is None or kern.release_gil()
        assert torch.get_num_threads() == 1
    assert len(other.output_token_ids) == before + 5
    assert eng.status is not status and eng.status.step == status.step + 5
    assert status.running == 1  # a published status never changes
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not req.output_token_ids
    conn.gate.set()
    outs = step_until(eng, lambda: not eng.has_unfinished_requests())
    assert kern is None or not kern.release_gil()  # the last steps loaded nothing
    assert torch.get_num_threads() == 2  # and ran on every thread again
    assert outs["loads"].outputs[0].token_ids == cold
    assert outs["loads"].num_cached_tokens == 40  # 10 blocks of 4 loaded, last token computed
    assert eng.scheduler.stats.loads_started == 1 and conn.loaded == 10
    assert settled_usage(eng) == 0


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_closing_while_loads_are_in_flight_gives_the_threads_back(warm_store, tiny_engine_factory,
                                                                  two_threads):  # fmt: skip
    store, prompt, _ = warm_store
    conn = GatedConnector(store)
    eng = tiny_engine_factory(connector=conn)
    eng.add_request("other", prompt_of(12, 9), SP)
    eng.add_request("loads", prompt, SP)
    step_until(eng, lambda: conn.started)
    eng.step()
    assert torch.get_num_threads() == 1
    conn.gate.set()
    eng.close()
    assert torch.get_num_threads() == 2


def test_short_load_recomputes_the_rest(warm_store, tiny_engine_factory):
    store, prompt, cold = warm_store
    conn = GatedConnector(store, fail_after=3)
    conn.gate.set()
    eng = tiny_engine_factory(connector=conn)
    out = generate_one(eng, prompt, SP)
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens == 12  # the 3 blocks that loaded
    assert eng.scheduler.stats.loads_partial == 1


def test_late_load_is_abandoned_and_recomputed(warm_store, tiny_engine_factory):
    store, prompt, cold = warm_store
    conn = GatedConnector(store)
    eng = tiny_engine_factory(connector=conn, kv_load_timeout_s=0.2)
    out = generate_one(eng, prompt, SP)  # the gate never opens in time
    assert out.outputs[0].token_ids == cold
    assert out.num_cached_tokens == 0
    assert eng.scheduler.stats.load_timeouts == 1 and conn.cancelled[0] == "r"
    held = eng.pool.usage()
    assert held > 0  # the late load's blocks are set aside: it may still write into them
    conn.gate.set()
    step_until(eng, lambda: not eng.has_work())
    assert settled_usage(eng) == 0


def test_abort_while_loading_frees_blocks_once_the_load_stops(warm_store, tiny_engine_factory):
    store, prompt, _ = warm_store
    conn = GatedConnector(store)
    eng = tiny_engine_factory(connector=conn)
    eng.add_request("r", prompt, SP)
    step_until(eng, lambda: conn.started)
    eng.abort_request("r")
    assert not eng.has_unfinished_requests() and eng.has_work()
    assert eng.pool.usage() > 0
    conn.gate.set()
    step_until(eng, lambda: not eng.has_work())
    assert settled_usage(eng) == 0 and conn.cancelled == ["r"]


def test_loads_in_flight_are_bounded(tiny_engine_factory):
    seed = DictConnector()
    warm = tiny_engine_factory(connector=seed)
    prompts = [prompt_of(20 + i, 21) for i in range(3)]
    colds = [generate_one(warm, p, SP).outputs[0].token_ids for p in prompts]
    warm.close()
    conn = GatedConnector(seed.store, max_loads=1)
    eng = tiny_engine_factory(connector=conn)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SP)
    step_until(eng, lambda: conn.started)
    for _ in range(5):
        eng.step()
    assert conn.started == ["r0"]  # the others wait for room, in the queue
    conn.gate.set()
    outs = step_until(eng, lambda: not eng.has_unfinished_requests())
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(3)] == colds
    assert sorted(conn.started) == ["r0", "r1", "r2"] and conn.peak == 1
    assert settled_usage(eng) == 0


def test_a_request_id_sent_again_during_its_aborted_load_gets_each_report_once():
    """A request aborted while its load runs, then sent again under the same id: the old
    load's end and the new one's are two reports, in order, never merged into one (the
    scheduler frees the old blocks on the first and runs the new request on the second)."""
    from kvpool.engine.connectors.base import BlockRef
    from kvpool.engine.connectors.prefetch import PoolView, Prefetcher

    gate, calls = threading.Event(), []

    def load(blocks, block_ids, source):
        calls.append(list(block_ids))
        gate.wait(10)
        return len(blocks)

    ref = BlockRef(block_id=0, block_hash=b"h" * 16, token_ids=(1,))
    p = Prefetcher(lambda hashes: [None] * len(hashes), load, PoolView())
    try:
        p.start_load("r", [ref], [3])
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.001)
        p.request_finished("r")  # aborted while its load runs
        p.start_load("r", [ref, ref], [5, 6])  # the same id again
        assert p.backlog_blocks() == 2  # the new load is the one in flight for "r"
        gate.set()
        reports, deadline = [], time.monotonic() + 10
        while len(reports) < 2 and time.monotonic() < deadline:
            reports += list(p.finished().items())
            time.sleep(0.005)
        assert reports == [("r", 1), ("r", 2)] and calls == [[3], [5, 6]]
        assert p.finished() == {} and p.backlog_blocks() == 0
    finally:
        p.close()


class GatedReads:
    """The real pool whose reads wait for ``gate`` (``reading`` is set once one waits)."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self.gate, self.reading = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def batch_get_into_parts(self, keys, buffers):
        self.reading.set()
        self.gate.wait(10)
        return self._pool.batch_get_into_parts(keys, buffers)


def test_an_id_aborted_twice_during_its_loads_frees_both_loads_blocks(tiny_engine_factory):
    from kvpool.engine.connectors.store import StoreConnector
    from kvpool.store.embedded import EmbeddedStore

    prompt = prompt_of(12, 41)
    with EmbeddedStore(memory="64MiB") as pool:
        warm_conn = StoreConnector(pool, fetch_policy=False)
        warm = tiny_engine_factory(connector=warm_conn)
        generate_one(warm, prompt, SP)
        assert warm_conn.wait_saved(list(warm.pool.cached_hashes()), 10)
        warm.close()
        gated = GatedReads(pool)
        eng = tiny_engine_factory(connector=StoreConnector(gated, fetch_policy=False))
        eng.add_request("r", prompt, SP)
        step_until(eng, gated.reading.is_set)  # the first load is reading
        eng.abort_request("r")
        eng.add_request("r", prompt, SP)  # the same id again: its load queues behind
        step_until(eng, lambda: "r" in eng.scheduler.loading)
        eng.abort_request("r")
        assert eng.pool.usage() > 0 and eng.has_work()  # both loads may still write
        gated.gate.set()
        step_until(eng, lambda: not eng.has_work())
        assert settled_usage(eng) == 0


@pytest.mark.parametrize("nice", [0, 5])
def test_background_threads_run_at_the_asked_priority(nice):
    """The load thread lowers its own CPU priority by ``nice`` (Linux, per thread; 0 leaves it
    at the caller's); the lookup thread keeps the caller's (a request waits on its answer)."""
    import os

    from kvpool.engine.connectors.prefetch import PoolView, Prefetcher

    base = os.getpriority(os.PRIO_PROCESS, 0)
    p = Prefetcher(lambda hashes: [None] * len(hashes), lambda b, i, s: len(b), PoolView(),
                   nice=nice)  # fmt: skip
    try:
        threads = [t for t in p._threads if t.native_id is not None]
        assert [t.name for t in threads] == ["kvpool-kv-lookup", "kvpool-kv-load"]
        deadline = time.monotonic() + 5
        want = [base, min(base + nice, 19)]
        got = []
        while time.monotonic() < deadline:
            got = [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threads]
            if got == want:
                break
            time.sleep(0.01)
        assert got == want
    finally:
        p.close()

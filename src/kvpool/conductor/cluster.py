"""The conductor's live view of the cluster: workers polled over RPC, the pool via its master.

Workers come from a static list of control addresses or from etcd (``/kvpool/workers/``). A
poller thread calls each worker's ``status`` every ``poll_interval`` seconds, applies its block
events to the worker's cached-hash set, and keeps its load and cost model. A worker that has
not answered for ``dead_after`` seconds is dropped from routing (and forgotten when etcd no
longer lists it). ``snapshot()`` returns the plain ``ClusterSnapshot`` the policies read: a
copy (its worker views and loads are its own; the cached-hash sets are immutable, replaced by
the poller), so a policy is a pure function of what it was handed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace

from kvpool.common.errors import KVPoolError
from kvpool.common.hashing import leading_true
from kvpool.common.rpc import RpcClient
from kvpool.conductor.cluster_state import (
    ClusterSnapshot,
    WorkerLoad,
    WorkerView,
    decay_backlog,
)
from kvpool.conductor.vllm import VllmBackend, VllmSpec, folder_namespace
from kvpool.protocol.cluster import WORKERS_PREFIX
from kvpool.protocol.worker import WorkerStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Worker:
    rpc: RpcClient | None  # a kvpool worker's control RPC (None: a vLLM server)
    view: WorkerView | None = None
    last_ok: float = field(default_factory=time.monotonic)
    event_seq: int = 0
    cached: frozenset[bytes] = frozenset()  # replaced, never changed: snapshots share it
    status: WorkerStatus | None = None  # its last answer
    inflight: int = 0
    failures: int = 0
    pending_tokens: int = 0  # prompt tokens of the prefills routed here, not yet done
    reported_queue: int = 0  # the queued prefill tokens of its last report
    backlogged: float = 0.0  # WorkerLoad.backlogged, as of backlog_at
    backlog_at: float = field(default_factory=time.monotonic)
    backend: VllmBackend | None = None  # a vLLM server's poller


class ClusterState:
    """Polls workers and the pool; thread-safe snapshots for the router."""

    def __init__(self, workers: list[str] | None = None, etcd: str | None = None,
                 store: str | None = None, poll_interval: float = 0.2,
                 dead_after: float = 2.0, token: str | None = None,
                 vllm: list[VllmSpec] | None = None, vllm_model: str | None = None,
                 vllm_dtype: str = "float32", vllm_api_key: str | None = None) -> None:  # fmt: skip
        self.static = list(workers or [])
        self.etcd = None
        if etcd:
            from kvpool.common.etcd import EtcdClient

            self.etcd = EtcdClient(etcd, timeout=2.0)
        self.poll_interval, self.dead_after, self.token = poll_interval, dead_after, token
        self._workers: dict[str, _Worker] = {}  # by rpc address
        self._lock = threading.Lock()
        self.store = None
        if store:
            from kvpool.store.link import MasterLink

            self.store = MasterLink(store, token=token, timeout=1.0)
        self.pool_up = self.store is not None
        self.pool_stats: dict = {}
        self._pool_checked = 0.0
        self.processes: dict[str, dict] = {}  # what a launcher started: name -> {pid, ...}
        self.directory: str | None = None  # the pool's segment directory, if a launcher ran it
        self.namespace: str | None = None
        self.block_size = 16
        self.block_bytes = 0
        self.max_model_len: int | None = None  # the workers' (None until one answered)
        self.vocab_size: int | None = None
        if vllm:  # their pool namespace (and so the hash chains) from the model folder
            if not vllm_model:
                raise ValueError("vLLM servers need the model folder they serve (vllm_model)")
            self.namespace, self.block_bytes = folder_namespace(vllm_model, vllm_dtype)
            for spec in vllm:
                self._workers[f"vllm:{spec.address}"] = _Worker(
                    None, backend=VllmBackend(spec, self.namespace, self.block_size, vllm_api_key)
                )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvpool-cluster", daemon=True)

    def start(self) -> ClusterState:
        self.poll_once()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        with self._lock:
            for w in self._workers.values():
                if w.rpc is not None:
                    w.rpc.close()
                if w.backend is not None:
                    w.backend.close()
        if self.store is not None:
            self.store.close()

    # -- polling ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.poll_once()
            except Exception:  # the poller must survive anything
                logger.exception("cluster poll failed")

    def _addresses(self) -> list[str]:
        addrs = list(self.static)
        if self.etcd is not None:
            try:
                for _, value in self.etcd.get_prefix(WORKERS_PREFIX):
                    addrs.append(json.loads(value)["rpc"])
            except (KVPoolError, ValueError, KeyError) as exc:
                logger.warning("worker discovery in etcd failed: %s", exc)
                with self._lock:
                    return list(self._workers) or addrs  # keep what we know
        return list(dict.fromkeys(addrs))

    def poll_once(self) -> None:
        with self._lock:
            vllm = [a for a, w in self._workers.items() if w.backend is not None]
        addrs = self._addresses() + vllm
        with self._lock:
            for a in addrs:
                if a not in self._workers:
                    self._workers[a] = _Worker(RpcClient(a, token=self.token, timeout=1.0))
            gone = [a for a in self._workers if a not in addrs]
            for a in gone:
                self._workers.pop(a).rpc.close()
            items = list(self._workers.items())
        for addr, w in items:
            if w.backend is not None:
                self._poll_vllm(w, w.backend)
            else:
                self._poll_worker(addr, w)
        self._poll_pool()

    def _failed(self, w: _Worker, addr: str, exc: Exception) -> None:
        w.failures += 1
        if w.view is not None and w.view.alive and self._dead(w):
            logger.warning("worker %s (%s) stopped answering: %s", w.view.id, addr, exc)
            w.view.alive = False

    def _poll_vllm(self, w: _Worker, b: VllmBackend) -> None:
        try:
            load = b.poll()
        except KVPoolError as exc:
            self._failed(w, b.spec.address, exc)
            return
        w.failures, w.last_ok, w.cached = 0, time.monotonic(), b.cached
        load.inflight = w.inflight
        if w.view is None:
            logger.info("vLLM %s joined: %s, model %s", b.spec.address, b.spec.role, b.model_id)
        w.view = WorkerView(b.id, b.spec.role, b.spec.address, "", load, cached=w.cached,
                            engine="vllm")  # fmt: skip
        if b.max_model_len and (self.max_model_len is None or b.max_model_len < self.max_model_len):
            self.max_model_len = b.max_model_len  # the smallest context any server takes

    def _poll_worker(self, addr: str, w: _Worker) -> None:
        assert w.rpc is not None
        try:
            st = WorkerStatus.from_wire(w.rpc.call("status", w.event_seq))
        except KVPoolError as exc:  # unreachable, or an answer that is not a status
            self._failed(w, addr, exc)
            return
        w.failures = 0
        w.last_ok = time.monotonic()
        if st.snapshot is not None or st.events:  # a new set: snapshots handed out keep theirs
            cached = set(st.snapshot) if st.snapshot is not None else set(w.cached)
            for e in st.events:
                (cached.add if e.kind == "stored" else cached.discard)(e.block_hash)
            w.cached = frozenset(cached)
        w.event_seq = st.event_seq
        w.status = st
        ld = st.load
        w.reported_queue = ld.queued_prefill_tokens
        _backlog(w, max(w.reported_queue, w.pending_tokens))  # sampled at polls and routings
        load = WorkerLoad(ld.queued_prefill_tokens, ld.running, ld.waiting, ld.kv_usage,
                          list(ld.remaining_tokens), w.inflight)  # fmt: skip
        if w.view is None:
            logger.info("worker %s joined: %s, http %s", st.id, st.role, st.http)
        w.view = WorkerView(st.id, st.role, st.http, st.rpc or addr, load, st.cost, w.cached,
                            st.alive, step_tokens=st.step_tokens)  # fmt: skip
        if self.namespace is None:
            self.namespace, self.block_size = st.namespace, st.block_size
            self.block_bytes = st.block_bytes
        if self.vocab_size is None and st.namespace == self.namespace:
            self.max_model_len = min(st.max_model_len, self.max_model_len or st.max_model_len)
            self.vocab_size = st.vocab_size
        elif st.namespace != self.namespace:
            logger.error("worker %s serves another model/KV format; not routing to it", st.id)
            w.view.alive = False

    def _dead(self, w: _Worker) -> bool:
        return time.monotonic() - w.last_ok > self.dead_after

    def _poll_pool(self) -> None:
        if self.store is None or time.monotonic() - self._pool_checked < 1.0:
            return
        self._pool_checked = time.monotonic()
        try:
            self.pool_stats = self.store.call("stats")
            self.pool_up = True
        except KVPoolError as exc:
            if self.pool_up:
                logger.warning("the pool's master is unreachable: %s", exc)
            self.pool_up = False

    # -- reading ---------------------------------------------------------------------------

    def snapshot(self) -> ClusterSnapshot:
        with self._lock:
            views = []
            for w in self._workers.values():
                if w.view is None:
                    continue
                if w.view.alive and self._dead(w):
                    w.view.alive = False
                queue = max(w.reported_queue, w.pending_tokens)
                load = replace(w.view.load, inflight=w.inflight, queued_prefill_tokens=queue,
                               backlogged=_backlog(w, queue),
                               remaining_tokens=list(w.view.load.remaining_tokens))  # fmt: skip
                views.append(replace(w.view, load=load))  # a copy: the poller goes on
        return ClusterSnapshot(views, block_bytes=self.block_bytes, pool_up=self.pool_up)

    def worker(self, worker_id: str) -> _Worker | None:
        with self._lock:
            for w in self._workers.values():
                if w.view is not None and w.view.id == worker_id:
                    return w
        return None

    def mark_failed(self, worker_id: str) -> None:
        """A request saw this worker fail: stop routing to it until it answers a poll again."""
        w = self.worker(worker_id)
        if w is not None and w.view is not None:
            w.view.alive = False
            w.last_ok = 0.0

    def pool_prefix_blocks(self, keys: list[str]) -> int:
        """How many leading blocks of a chain the pool holds (0 when it is unreachable)."""
        if self.store is None or not self.pool_up or not keys:
            return 0
        try:
            present = self.store.call("batch_exists", keys)
        except KVPoolError:
            self.pool_up = False
            return 0
        return leading_true(present)

    def describe(self) -> dict:
        """The ``/cluster`` document."""
        snap = self.snapshot()
        workers = []
        with self._lock:
            statuses = {w.view.id: w.status for w in self._workers.values() if w.view}
        for v in snap.workers:
            st = statuses.get(v.id)
            w = self.worker(v.id)
            workers.append({
                "id": v.id, "role": v.role, "address": v.address, "rpc": v.rpc,
                "alive": v.alive, "pid": st.pid if st else None, "load": v.load.to_dict(),
                "cost": v.cost.to_dict(),
                "cached_blocks": len(v.cached), "counters": st.counters if st else {},
                **(w.backend.describe() if w is not None and w.backend is not None else {}),
            })  # fmt: skip
        store = {"up": self.pool_up, **self.pool_stats} if self.store is not None else None
        return {"workers": workers, "store": store, "namespace": self.namespace,
                "block_size": self.block_size, "processes": self.processes,
                "directory": self.directory}  # fmt: skip


def _backlog(w: _Worker, queue: int) -> float:
    """``w``'s ``WorkerLoad.backlogged`` now, its prefill queue ``queue`` tokens since the
    last sample."""
    now = time.monotonic()
    w.backlogged = decay_backlog(w.backlogged, queue > 0, now - w.backlog_at)
    w.backlog_at = now
    return w.backlogged

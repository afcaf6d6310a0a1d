"""The engine's KV connector backed by the pool (``kvpool.store``), in both roles.

One pool object per KV block, read and written straight from and into the KV tensor
(``pool_blocks.py``); loaded token ids are compared with the request's: a mismatch ends the
loaded prefix there.

Asynchronous by default (``async_load``): the scheduler side answers from a local view of the
pool fed by background lookups (no RPC on the engine step) and loads run on a background
thread while the engine steps other requests (``prefetch.py``). ``async_load=False`` keeps the
synchronous path: a lookup RPC and the load itself inside the step (the baseline of
``benchmarks/bench_overlap.py``). Saves always run on a background thread while the engine
computes the next chunk; the engine keeps each block referenced until its save is reported
done. If the pool cannot be reached the connector stops using it for ``retry_after_s`` and the
engine computes everything locally.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvpool.common.errors import BadRequestError, KVPoolError
from kvpool.common.hashing import leading_true
from kvpool.engine.connectors.base import BlockRef, KVConnector
from kvpool.engine.connectors.direct import DirectReads
from kvpool.engine.connectors.fetch_policy import PROBE_BLOCKS, FetchPolicy, FetchStats
from kvpool.engine.connectors.pool_blocks import PoolBlocks
from kvpool.engine.connectors.prefetch import BACKGROUND_NICE, PoolView, Prefetcher
from kvpool.engine.connectors.saves import Saver
from kvpool.engine.request import Request
from kvpool.protocol.kv_object import block_key

logger = logging.getLogger(__name__)
SYNC_SHARE = 0.2  # a load predicted under this share of the running step is done inside it
QUICK_TIMEOUT = 0.25  # seconds a direct read inside the step may take before the pool is asked


@dataclass(slots=True)
class ConnectorStats:
    """Counters for metrics (cumulative)."""

    lookups: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    token_mismatches: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    save_seconds: float = 0.0  # time the save thread spent writing
    save_wait_seconds: float = 0.0  # time callers waited for saves (the part not hidden)
    dropped_saves: int = 0
    pool_errors: int = 0


class StoreConnector(KVConnector):
    """Loads prefix blocks from the pool and publishes full blocks to it."""

    def __init__(self, client, retry_after_s: float = 5.0, save: bool = True, *,
                 async_load: bool = True, max_loads: int = 8,
                 fetch_policy: bool = True, direct: bool = True,
                 arrival_lookups: bool = True,
                 load_nice: int = BACKGROUND_NICE) -> None:  # fmt: skip
        self.client = client  # a kvpool.store.StoreClient (thread-safe)
        self.retry_after_s = retry_after_s
        self._save_enabled = save
        self.async_load = async_load
        self.view = PoolView()
        self._max_loads = max_loads
        self._prefetch: Prefetcher | None = None
        self._use_policy = fetch_policy and async_load
        self.policy: FetchPolicy | None = None  # set at bind (it needs the block size)
        self._decided: dict[str, tuple[int, float | None]] = {}  # request -> (load?, predicted)
        self._tiers: dict[str, str] = {}  # request -> the pool tier its blocks are in
        self._tiers_rpc = True  # the master answers batch_tiers (else: batch_exists)
        self._started: dict[str, tuple[float, float | None]] = {}  # request -> (when, predicted)
        # look a request up when it arrives (``request_arrived``); False: when the scheduler
        # first considers it (the behaviour before; bench_overlap.py compares the two)
        self.arrival_lookups = arrival_lookups
        self._load_nice = load_nice  # the background threads' nice value (prefetch.py)
        self._use_direct = direct and async_load
        self.direct: DirectReads | None = None  # set at bind (it needs the KV tensor)
        self._direct_jobs: dict[str, object] = {}  # request -> the KV handle it loads from
        self._sync_sources: dict[bytes, object] = {}  # first block hash -> handle (quick reads)
        self._step_s = None  # the engine's prediction of its current step (set_cost_model)
        self.stats = ConnectorStats()
        self._down_until = 0.0
        self._blocks: np.ndarray | None = None  # [num_blocks, block_bytes] uint8 view
        self._io: PoolBlocks | None = None  # its blocks as pool objects (set at bind)
        self._saver: Saver | None = None  # set at bind
        self._closed = False

    # -- binding -------------------------------------------------------------------------

    def bind(self, kv_cache: torch.Tensor, block_size: int, namespace: str) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError("the KV tensor must be contiguous (block-major)")
        flat = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
        self._blocks = flat.numpy().reshape(kv_cache.shape[0], -1)  # shares memory
        self.block_size = block_size
        self.namespace = namespace
        self._io = PoolBlocks(self.client, self._blocks, block_size)
        if self._use_policy:
            self.policy = FetchPolicy(self._io.head_len + self.block_bytes, block_size)
        engine = getattr(self.client, "engine", None)
        if self._use_direct and hasattr(engine, "register") and hasattr(self.client, "io"):
            self.direct = DirectReads(engine, self._blocks, self._io.checksum, self._io.header)
            self.direct.publish()
        if self.async_load:
            on_loaded = self.policy.observe_load if self.policy is not None else None
            self._prefetch = Prefetcher(self._exists, self._load_now, self.view, self._max_loads,
                                        on_loaded=on_loaded, probe=self._io.probe,
                                        nice=self._load_nice)  # fmt: skip
        if self._save_enabled:
            self._saver = Saver(self._write, self._waited).start()

    @property
    def block_bytes(self) -> int:
        assert self._blocks is not None
        return self._blocks.shape[1]

    def _waited(self, seconds: float) -> None:
        self.stats.save_wait_seconds += seconds  # save time the engine did wait for

    def pool_up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _pool_failed(self, what: str, exc: Exception) -> None:
        self.stats.pool_errors += 1
        if self.pool_up():
            logger.warning("pool %s failed (%s); computing locally for %.0fs", what, exc,
                           self.retry_after_s)  # fmt: skip
        self._down_until = time.monotonic() + self.retry_after_s

    # -- scheduler side (asynchronous) --------------------------------------------------------

    def request_arrived(self, block_hashes: list[bytes]) -> None:
        p = self._prefetch
        if p is None or not self.arrival_lookups or not block_hashes or not self.pool_up():
            return
        # not when even a full hit would not pay (the scheduler will not look it up either)
        if self.policy is None or self.policy.worth_looking_up(len(block_hashes),
                                                               p.backlog_blocks()):  # fmt: skip
            p.hint(block_hashes)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._prefetch is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not self.pool_up():
            return 0, False
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = request.block_hashes[num_computed_tokens // bs : max_blocks]
        if not hashes:
            return 0, False
        rid = request.request_id
        self._sync_sources.clear()  # only the request asked now may load inside this step
        handle = getattr(request, "kv_handle", None)
        if handle is not None and self.direct is not None:  # the prefill worker holds them
            n = self.direct.usable(handle, request.block_hashes[:max_blocks],
                                   num_computed_tokens // bs)  # fmt: skip
            if n:
                if self._quick(self.direct.predict_s(n)):
                    self._sync_sources[request.block_hashes[num_computed_tokens // bs]] = handle
                    return n * bs, False  # read inside this step: sooner than the next one
                self._direct_jobs[rid] = handle
                return n * bs, True
        backlog = self._prefetch.backlog_blocks()
        if self.policy is not None:
            decided = self._decided.get(rid)
            if decided is None and not self.policy.worth_looking_up(len(hashes), backlog):
                decided = self._decided[rid] = (0, None)  # even a full hit would not pay
                self.policy.stats.skipped_lookups += 1
            if decided is not None and not decided[0]:
                return 0, False
        n = self._prefetch.matched_blocks(rid, hashes)
        if n is None:
            return None, True
        if n and self.policy is not None:
            tier = self._tiers.setdefault(rid, self.view.tier(hashes[:n]))
            if rid not in self._decided:
                self._decided[rid] = self.policy.decide(n, backlog, tier)
                if not self._decided[rid][0] and self.policy.wants_probe(tier):
                    held = hashes[:n] if tier == "dram" else self.view.on_ssd(hashes[:n])
                    self._prefetch.probe(held[:PROBE_BLOCKS], tier)
            n = min(n, self._decided[rid][0])
            load_s = self.policy.model(tier).predict(n * self.policy.block_bytes)
            if n and not backlog and self._quick(load_s):
                return n * bs, False  # inside this step (see ``_quick``)
        return n * bs, n > 0

    def _quick(self, load_s: float | None) -> bool:
        """Whether a load is better done inside the current step: it is predicted to take at
        most ``SYNC_SHARE`` of the running batch's step (what it adds to their TBT), against a
        whole step of waiting for the request (a background load is picked up at the next
        step), or nothing else runs."""
        if load_s is None:
            return False
        step = self._step_s() if self._step_s is not None else 0.0
        return step <= 0 or load_s <= SYNC_SHARE * step

    def update_state_after_alloc(
        self, request: Request, blocks: list[BlockRef], block_ids: list[int]
    ) -> None:
        assert self._prefetch is not None, "asynchronous loads need async_load=True"
        rid = request.request_id
        self._started[rid] = (time.monotonic(), self._decided.get(rid, (0, None))[1])
        self._prefetch.start_load(rid, blocks, block_ids, self._direct_jobs.pop(rid, None),
                                  self._tiers.pop(rid, "dram"))  # fmt: skip

    def request_finished(self, request_id: str) -> None:
        self._direct_jobs.pop(request_id, None)
        self._tiers.pop(request_id, None)
        self._decided.pop(request_id, None)
        self._started.pop(request_id, None)
        if self._prefetch is not None:
            self._prefetch.request_finished(request_id)

    def get_finished(self) -> dict[str, int]:
        if self._prefetch is None:
            return {}
        done = self._prefetch.finished()
        now = time.monotonic()
        for rid in done:
            started = self._started.pop(rid, None)
            self._decided.pop(rid, None)
            if started is not None and self.policy is not None:
                self.policy.observe_wait(now - started[0], started[1])
        return done

    def set_cost_model(self, compute_s, step_s) -> None:
        self._step_s = step_s
        if self.policy is not None:
            self.policy.compute_s, self.policy.step_s = compute_s, step_s

    def fetch_stats(self) -> FetchStats | None:
        return self.policy.stats if self.policy is not None else None

    def wait_for_events(self, timeout: float) -> None:
        if self._prefetch is not None:
            self._prefetch.wait(timeout)

    def _exists(self, hashes: list[bytes]) -> list:
        """Per hash the pool tier that holds its block ("dram", "ssd"), or None (a client
        without tiers, e.g. a test double: a flag)."""
        self.stats.lookups += 1
        keys = [block_key(h) for h in hashes]
        try:
            if self._tiers_rpc and hasattr(self.client, "batch_tiers"):
                try:
                    return self.client.batch_tiers(keys)
                except BadRequestError as exc:  # a master from before batch_tiers
                    if "unknown method" not in str(exc):
                        raise
                    self._tiers_rpc = False
            return self.client.batch_exists(keys)
        except KVPoolError as exc:
            self._pool_failed("lookup", exc)
            raise

    # -- worker side ---------------------------------------------------------------------------

    def num_loadable_blocks(self, block_hashes: list[bytes], start: int) -> int:
        if not self.pool_up() or start >= len(block_hashes):
            return 0
        try:
            present = self._exists(block_hashes[start:])
        except KVPoolError:
            return 0
        return leading_true(present)

    def load(self, blocks: list[BlockRef], block_ids: list[int]) -> int:
        """A load inside the step: the synchronous path, or a quick one (``_quick``)."""
        source = self._sync_sources.pop(blocks[0].block_hash, None) if blocks else None
        t0 = time.perf_counter()
        n = self._load_now(blocks, block_ids, source, quick=True)
        if source is None and self.policy is not None and n:
            tier = self.view.tier([b.block_hash for b in blocks])
            self.policy.observe_load(len(blocks), time.perf_counter() - t0, tier)
        return n

    def _load_now(self, blocks: list[BlockRef], block_ids: list[int], source=None,
                  quick: bool = False) -> int:  # fmt: skip
        """Fill ``block_ids``: from the engine a KV handle (``source``) names where it can,
        the rest from the pool; how many leading blocks arrived. ``quick``: inside the step,
        so a direct read gets a short deadline (a dead peer must not hold the step)."""
        n = 0
        if source is not None and self.direct is not None:
            n = self.direct.read(source, blocks, block_ids, QUICK_TIMEOUT if quick else None)
            self.stats.loaded_blocks += n
            self.stats.loaded_bytes += n * self.block_bytes
            if n == len(blocks):
                return n
        return n + self._load_pool(blocks[n:], block_ids[n:])

    def kv_handle(self, hashes: list[bytes], tail=None):
        """Where this engine's saved blocks of a prompt (chain ``hashes``) are, for a decode
        worker to read directly (None: nothing published); ``tail``: its partial last block
        (``take_tail``)."""
        return self.direct.handle(hashes, tail) if self.direct is not None else None

    def expect_tail(self, request_id: str) -> None:
        if self.direct is not None:
            self.direct.expect_tail(request_id)

    def take_tail(self, request_id: str):
        return self.direct.take_tail(request_id) if self.direct is not None else None

    def request_done(self, request: Request) -> None:
        if self.direct is not None:
            self.direct.capture_tail(request, self.block_size)

    def load_tail(self, request: Request, computed: int, block_id: int) -> int:
        if self.direct is None:
            return 0
        return self.direct.load_tail(request, computed, block_id, self.block_size, QUICK_TIMEOUT)

    def _load_pool(self, blocks: list[BlockRef], block_ids: list[int]) -> int:
        assert self._io is not None
        if not blocks or not self.pool_up():
            return 0
        t0 = time.perf_counter()
        try:
            n, mismatched = self._io.read(blocks, block_ids)
        except KVPoolError as exc:
            self._pool_failed("load", exc)
            return 0
        self.stats.token_mismatches += mismatched
        self.stats.loaded_blocks += n
        self.stats.loaded_bytes += n * self.block_bytes
        self.stats.load_seconds += time.perf_counter() - t0
        return n

    # -- saving --------------------------------------------------------------------------

    @property
    def saves(self) -> bool:
        return self._save_enabled

    def save(self, blocks: list[BlockRef]) -> None:
        assert self._saver is not None, "saves are off"
        self._saver.save(blocks)

    def poll_saved(self) -> list[int]:
        return self._saver.poll_saved() if self._saver is not None else []

    def wait_saved(self, block_hashes: list[bytes], timeout: float) -> bool:
        return self._saver.wait_saved(block_hashes, timeout) if self._saver is not None else True

    def _write(self, refs: list[BlockRef]) -> None:
        """One batch of saves into the pool (on the save thread)."""
        assert self._io is not None
        t0 = time.perf_counter()
        if self.pool_up():
            try:
                kept = self._io.write(refs)
            except KVPoolError as exc:
                self._pool_failed("save", exc)
                kept = []
            stored = [r.block_hash for r, _ in kept]
            self.view.mark(stored, True)
            if self.direct is not None and kept:  # the block is still held: its bytes are these
                self.direct.record([r for r, _ in kept],
                                   [self._io.checksum(r.block_hash, ps) for r, ps in kept])  # fmt: skip
            self.stats.saved_blocks += len(stored)
            self.stats.saved_bytes += len(stored) * self.block_bytes
            self.stats.dropped_saves += len(refs) - len(stored)
        else:
            self.stats.dropped_saves += len(refs)
        self.stats.save_seconds += time.perf_counter() - t0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._saver is not None:
            self._saver.close()
        if self._prefetch is not None:
            self._prefetch.close()


__all__ = ["ConnectorStats", "StoreConnector", "block_key"]

"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Every step the scheduler hands out up to ``max_num_batched_tokens`` tokens: first to running
requests (a decode costs one token; an unfinished prefill continues with the next chunk), then
to waiting ones, oldest first. A request's prompt that does not fit the remaining budget is cut
into chunks, so long prompts interleave with decodes instead of stalling them. When the pool
runs out of blocks the most recently admitted running request is preempted: its blocks are
freed and it is recomputed later (its cached prefix usually survives in the prefix cache).

Prefix blocks the connector holds are loaded in the background when it says so: the request
gets its blocks, waits in ``WAITING_FOR_REMOTE_KVS`` while everything else keeps stepping, and
returns to the front of the queue once the load reports back, with the loaded prefix counted
as computed. A load that fails, loads only a prefix, or misses its deadline costs nothing but
recompute (a late load's blocks are set aside until it stops writing into them).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvpool.engine.block_pool import KVBlock
from kvpool.engine.connectors.base import BlockRef, KVConnector, NoopConnector
from kvpool.engine.kv_cache_manager import KVCacheManager, PrefixHit
from kvpool.engine.model_runner import ScheduledChunk
from kvpool.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)
_NO_HIT = PrefixHit([], 0)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_load_timeout_s: float = 10.0  # an asynchronous load taking longer is recomputed

    def __post_init__(self) -> None:
        if not self.kv_load_timeout_s > 0:
            raise ValueError("kv_load_timeout_s must be > 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")


@dataclass(slots=True)
class SchedulerStats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found in the engine's own cache
    external_hits: int = 0  # of which loaded through the connector
    preemptions: int = 0
    steps: int = 0
    loads_started: int = 0  # asynchronous prefix loads
    loads_partial: int = 0  # of which loaded less than asked (the rest recomputed)
    load_timeouts: int = 0  # of which missed their deadline (all recomputed)


@dataclass(slots=True)
class _Load:
    """A request whose prefix blocks are being loaded in the background."""

    req: Request
    hit_tokens: int  # from the engine's own prefix cache
    num_blocks: int  # asked of the connector, after those
    deadline: float


@dataclass(slots=True)
class Schedule:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    new_blocks: list[BlockRef] = field(default_factory=list)  # full once this step computes
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks, first

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, connector: KVConnector | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector or NoopConnector()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, _Load] = {}
        self._ready: set[str] = set()  # loaded, back in ``waiting`` with their blocks
        self._no_external: set[str] = set()  # their load timed out: compute everything
        # abandoned loads' blocks, until reported; per request id in load order (an id sent
        # again and abandoned again has two; the connector reports its loads in that order)
        self._orphans: dict[str, list[list[KVBlock]]] = {}
        self.stats = SchedulerStats()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_forked(self, child: Request) -> None:
        """A sequence forked from a running request (its blocks already shared): it runs."""
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self._orphans)

    def schedule(self) -> Schedule:
        self._collect_loads()
        out = Schedule()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        # Decodes first: the runner batches one-token queries together.
        out.chunks.sort(key=lambda c: c.num_tokens != 1)
        out.copies = self.kv.take_copies()
        self.stats.steps += 1
        return out

    def _schedule_running(self, out: Schedule, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._add_chunk(out, req, req.num_computed_tokens, n)
                budget -= n
                i += 1
        return budget

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s", req)

    def _schedule_waiting(self, out: Schedule, budget: int) -> None:
        skipped: list[Request] = []  # the connector cannot tell yet: ask again next step
        try:
            while self.waiting and budget > 0 and self._seats(self.waiting[0]):
                req = self.waiting[0]
                if req.request_id in self._ready:  # its prefix was loaded in the background
                    n = min(req.num_tokens - req.num_computed_tokens, budget)
                    if self.kv.allocate(req, n) is None:
                        break
                    self.waiting.popleft()
                    self._ready.discard(req.request_id)
                    self._start(out, req, req.num_computed_tokens, n)
                    budget -= n
                    continue
                hit = self.kv.find_prefix(req) if not req.needs_prompt_logprobs else _NO_HIT
                ext, load_async = self._external_tokens(req, hit.num_tokens)
                if ext is None:
                    skipped.append(self.waiting.popleft())
                    continue
                if ext and load_async:
                    # every block of its prompt now: a loaded request must never wait for a
                    # block that only other loaded (never preempted) requests hold
                    rest = req.num_tokens - hit.num_tokens - ext
                    if self.kv.allocate(req, rest, prefix=hit.blocks, num_external=ext) is None:
                        break
                    self.waiting.popleft()
                    self._start_load(req, hit.num_tokens, ext // self.kv.block_size)
                    continue
                budget -= self._admit_sync(out, req, hit, ext, budget)
                if req.status is not RequestStatus.RUNNING:
                    break  # not enough free blocks: wait for running requests to finish
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _seats(self, req: Request) -> bool:
        """Room for ``req`` (and the sequences it will fork into) among the running ones; a
        request wider than ``max_num_seqs`` runs alone."""
        busy = len(self.running) + len(self.loading)
        width = req.params.n if req.fork_pending else 1
        return busy == 0 or busy + width <= self.config.max_num_seqs

    def _admit_sync(self, out: Schedule, req: Request, hit, ext: int, budget: int) -> int:
        """Admit ``req`` with a synchronous external load (if any); the tokens scheduled."""
        computed = hit.num_tokens + ext
        n = min(req.num_tokens - computed, budget)
        if self.kv.allocate(req, n, prefix=hit.blocks, num_external=ext) is None:
            return 0
        self.waiting.popleft()
        req.num_computed_tokens = hit.num_tokens
        if ext:
            start, count = len(hit.blocks), ext // self.kv.block_size
            computed = hit.num_tokens + self._load_external(req, start, count)
            req.num_computed_tokens = computed
            n = min(req.num_tokens - computed, budget)
        tail = self._load_tail(req, computed)
        if tail:
            computed += tail
            req.num_computed_tokens = computed
            n = min(req.num_tokens - computed, budget)
        self._count_admission(req, hit.num_tokens, computed)
        self.kv.cache_full_blocks(req, computed)  # loaded blocks: no need to save them back
        self._start(out, req, computed, n)
        return n

    def _start(self, out: Schedule, req: Request, start: int, n: int) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._add_chunk(out, req, start, n)

    def _count_admission(self, req: Request, hit_tokens: int, computed: int) -> None:
        if req.num_cached_tokens < 0:  # first admission: count the prefix cache query
            req.num_cached_tokens = computed
            self.stats.prefix_queries += req.num_prompt_tokens
            self.stats.prefix_hits += hit_tokens
            self.stats.external_hits += computed - hit_tokens
            req.metrics.first_scheduled_time = time.monotonic()

    def _add_chunk(self, out: Schedule, req: Request, start: int, n: int) -> None:
        out.chunks.append(ScheduledChunk(req, start, n))
        out.new_blocks.extend(self.kv.cache_full_blocks(req, start + n))

    def _external_tokens(self, req: Request, hit_tokens: int) -> tuple[int | None, bool]:
        """(tokens the connector provides after ``hit_tokens`` (None: it cannot tell yet),
        whether it loads them in the background)."""
        bs = self.kv.block_size
        max_blocks = (req.num_tokens - 1) // bs
        if req.request_id in self._no_external or hit_tokens // bs >= max_blocks:
            return 0, False
        if req.needs_prompt_logprobs:  # every prompt position must be computed here
            return 0, False
        try:
            n, load_async = self.connector.get_num_new_matched_tokens(req, hit_tokens)
        except Exception:
            logger.exception("KV connector lookup failed for %s; computing locally",
                             req.request_id)  # fmt: skip
            return 0, False
        if n is None:
            return None, load_async
        return max(0, min(n // bs, max_blocks - hit_tokens // bs)) * bs, load_async

    def _load_tail(self, req: Request, computed: int) -> int:
        """The prompt's partial last block from the connector (a prefill worker's hand-off)
        once the full blocks before it are in place; the tokens it holds (0: none)."""
        bs = self.kv.block_size
        index = computed // bs
        if req.needs_prompt_logprobs or computed % bs or index >= len(req.block_ids):
            return 0
        try:
            return self.connector.load_tail(req, computed, req.block_ids[index])
        except Exception:
            logger.exception("KV connector tail load failed for %s; computing it",
                             req.request_id)  # fmt: skip
            return 0

    def _refs(self, req: Request, start: int, n: int) -> list[BlockRef]:
        bs = self.kv.block_size
        ids, hashes, toks = req.block_ids, req.block_hashes, req.token_ids
        return [BlockRef(ids[i], hashes[i], tuple(toks[i * bs : (i + 1) * bs]))
                for i in range(start, start + n)]  # fmt: skip

    def _load_external(self, req: Request, start: int, n: int) -> int:
        """Let the connector fill blocks [start, start + n) now; returns the tokens it loaded."""
        try:
            refs = self._refs(req, start, n)
            loaded = self.connector.load(refs, req.block_ids[start : start + n])
        except Exception:
            logger.exception("KV connector load failed for %s; computing locally", req.request_id)
            loaded = 0
        return max(0, min(loaded, n)) * self.kv.block_size

    # -- asynchronous loads -------------------------------------------------------------------

    def _start_load(self, req: Request, hit_tokens: int, n: int) -> None:
        start = hit_tokens // self.kv.block_size
        req.num_computed_tokens = hit_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        deadline = time.monotonic() + self.config.kv_load_timeout_s
        self.loading[req.request_id] = _Load(req, hit_tokens, n, deadline)
        self.stats.loads_started += 1
        refs = self._refs(req, start, n)
        try:
            self.connector.update_state_after_alloc(req, refs, req.block_ids[start : start + n])
        except Exception:
            logger.exception("KV connector could not start a load for %s; computing locally",
                             req.request_id)  # fmt: skip
            self._abandon(req, recompute=True, started=False)

    def _collect_loads(self) -> None:
        """Loads that reported back go to the front of the queue, ready to run; loads past
        their deadline are abandoned and their requests recomputed."""
        if not (self.loading or self._orphans):
            return
        back: list[Request] = []
        for rid, n in self.connector.get_finished().items():
            orphaned = self._orphans.get(rid)
            if orphaned:
                self.kv.release(orphaned.pop(0))  # that abandoned load stopped writing there
                if not orphaned:
                    del self._orphans[rid]
                continue
            load = self.loading.pop(rid, None)
            if load is not None:
                back.append(self._loaded(load, n))
        now = time.monotonic()
        for load in [ld for ld in self.loading.values() if now >= ld.deadline]:
            logger.warning("KV load for %s missed its %.1fs deadline; computing locally",
                           load.req.request_id, self.config.kv_load_timeout_s)  # fmt: skip
            self.stats.load_timeouts += 1
            back.append(self._abandon(load.req, recompute=False))
        back.sort(key=lambda r: r.metrics.arrival_time)
        self.waiting.extendleft(reversed(back))

    def _loaded(self, load: _Load, n: int) -> Request:
        req = load.req
        n = max(0, min(n, load.num_blocks))
        if n < load.num_blocks:
            self.stats.loads_partial += 1
        computed = load.hit_tokens + n * self.kv.block_size
        if n == load.num_blocks:  # the whole prefix arrived: its partial last block too?
            computed += self._load_tail(req, computed)
        req.num_computed_tokens = computed
        self.kv.cache_full_blocks(req, computed)  # the loaded ones only; the rest is computed
        self._count_admission(req, load.hit_tokens, computed)
        req.status = RequestStatus.WAITING
        self._ready.add(req.request_id)
        return req

    def _abandon(self, req: Request, recompute: bool, started: bool = True) -> Request:
        """Give up ``req``'s load: its blocks wait for the load to stop (``started``); it
        computes everything itself (``recompute``: put it back in the queue here)."""
        rid = req.request_id
        self.loading.pop(rid, None)
        if started:
            self.connector.request_finished(rid)
            self._orphans.setdefault(rid, []).append(self.kv.detach(req))
        else:
            self.kv.free(req)
        self._no_external.add(rid)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        if recompute:
            self.waiting.appendleft(req)
        return req

    def finish(self, req: Request) -> None:
        """Remove a finished (or aborted) request and free its blocks."""
        rid = req.request_id
        self._ready.discard(rid)
        if rid in self.loading:  # its load may still write into its blocks
            self._abandon(req, recompute=False)
            self._no_external.discard(rid)
            return
        self._no_external.discard(rid)
        self.connector.request_finished(rid)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

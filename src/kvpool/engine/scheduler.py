"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Every step the scheduler hands out up to ``max_num_batched_tokens`` tokens: first to running
requests (a decode costs one token; an unfinished prefill continues with the next chunk), then
to waiting ones, oldest first. A request's prompt that does not fit the remaining budget is cut
into chunks, so long prompts interleave with decodes instead of stalling them. When the pool
runs out of blocks the most recently admitted running request is preempted: its blocks are
freed and it is recomputed later (its cached prefix usually survives in the prefix cache).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvpool.engine.connector import BlockRef, KVConnector, NoopConnector
from kvpool.engine.kv_cache_manager import KVCacheManager
from kvpool.engine.model_runner import ScheduledChunk
from kvpool.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
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


@dataclass(slots=True)
class Schedule:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    new_blocks: list[BlockRef] = field(default_factory=list)  # full once this step computes

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
        self.stats = SchedulerStats()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Schedule:
        out = Schedule()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        # Decodes first: the runner batches one-token queries together.
        out.chunks.sort(key=lambda c: c.num_tokens != 1)
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
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.find_prefix(req)
            n_ext = self._external_blocks(req, len(hit.blocks))
            ext_tokens = n_ext * self.kv.block_size
            computed = hit.num_tokens + ext_tokens
            n = min(req.num_tokens - computed, budget)
            new = self.kv.allocate(req, n, prefix=hit.blocks, num_external=ext_tokens)
            if new is None:
                break  # not enough free blocks: wait for running requests to finish
            self.waiting.popleft()
            req.num_computed_tokens = hit.num_tokens
            if n_ext:
                computed = hit.num_tokens + self._load_external(req, len(hit.blocks), n_ext)
                req.num_computed_tokens = computed
                n = min(req.num_tokens - computed, budget)
            if req.num_cached_tokens < 0:  # first admission: count the prefix cache query
                req.num_cached_tokens = computed
                self.stats.prefix_queries += req.num_prompt_tokens
                self.stats.prefix_hits += hit.num_tokens
                self.stats.external_hits += computed - hit.num_tokens
                req.metrics.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.kv.cache_full_blocks(req, computed)  # loaded blocks: no need to save them back
            self._add_chunk(out, req, computed, n)
            budget -= n

    def _add_chunk(self, out: Schedule, req: Request, start: int, n: int) -> None:
        out.chunks.append(ScheduledChunk(req, start, n))
        out.new_blocks.extend(self.kv.cache_full_blocks(req, start + n))

    def _external_blocks(self, req: Request, start: int) -> int:
        max_blocks = (req.num_tokens - 1) // self.kv.block_size
        if start >= max_blocks:
            return 0
        n = self.connector.num_loadable_blocks(req.block_hashes[:max_blocks], start)
        return max(0, min(n, max_blocks - start))

    def _load_external(self, req: Request, start: int, n: int) -> int:
        """Let the connector fill blocks [start, start + n); returns the tokens it loaded."""
        bs = self.kv.block_size
        refs = [
            BlockRef(0, req.block_hashes[i], tuple(req.token_ids[i * bs : (i + 1) * bs]))
            for i in range(start, start + n)
        ]
        try:
            loaded = self.connector.load(refs, req.block_ids[start : start + n])
        except Exception:
            logger.exception("KV connector load failed for %s; computing locally", req.request_id)
            loaded = 0
        return max(0, min(loaded, n)) * bs

    def finish(self, req: Request) -> None:
        """Remove a finished (or aborted) request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

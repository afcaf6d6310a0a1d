"""The engine: requests in, one scheduled forward pass per ``step()``, outputs out."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpool.common.errors import BadRequestError, NotFoundError
from kvpool.common.hashing import block_hashes, kv_namespace, namespace_seed
from kvpool.config import EngineConfig
from kvpool.engine.block_pool import BlockPool
from kvpool.engine.connectors.base import BlockRef, KVConnector, NoopConnector
from kvpool.engine.decode_meter import DecodeFigures, DecodeMeter
from kvpool.engine.kv_cache_manager import KVCacheManager
from kvpool.engine.limits import check_context_length, check_prompt_chars, check_token_ids
from kvpool.engine.loads_in_flight import LoadsInFlight
from kvpool.engine.model_runner import ModelRunner, ScheduledChunk
from kvpool.engine.output import OutputProcessor
from kvpool.engine.request import Request, RequestOutput, RequestStatus
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.scheduler import Scheduler, SchedulerConfig
from kvpool.engine.step_model import StepCosts
from kvpool.model.kernels import paged_kernels
from kvpool.model.kv_layout import allocate_kv_cache, kv_bytes_per_block
from kvpool.model.llama import LlamaModel
from kvpool.model.loader import LoadedModel, load_model
from kvpool.model.machine import known_limits
from kvpool.protocol.worker import MAX_REMAINING, EngineStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    """A snapshot for metrics exporters (token counts are cumulative)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    external_prefix_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    kv_fetch_loads: int = 0  # prefixes the connector chose to load
    kv_fetch_recomputes: int = 0  # prefixes the pool held that it chose to recompute
    kv_fetch_skipped: int = 0  # prefixes too short to be worth even a lookup
    kv_fetch_ties: int = 0  # of the loads and recomputes, those decided as ties (fetch_policy)
    kv_fetch_predicted_seconds: float = 0.0  # its predicted waits for those loads...
    kv_fetch_realized_seconds: float = 0.0  # ...and what they were
    decode: DecodeFigures | None = None  # the roofline of recent decode-only steps
    threads: int = 0  # torch threads of the last step (0: not known to the engine)
    widened_steps: int = 0  # steps on the cores of idle workers (engine/core_share.py)


class LLMEngine:
    """Continuous-batching engine over a paged, prefix-cached KV tensor."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        model: LoadedModel | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = getattr(torch, config.dtype)
        t0 = time.perf_counter()
        self.loaded = model or load_model(config.model, dtype=dtype)
        self.model_config = mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.model = LlamaModel(mc, self.loaded.weights, dtype, config.weights,
                                config.kv_cache_dtype, self.loaded.path)  # fmt: skip
        self.block_size = bs = config.block_size
        num_blocks = config.num_kv_blocks or max(
            2, config.kv_cache_memory_bytes // kv_bytes_per_block(self.model, bs) + 1
        )
        self.kv_cache = allocate_kv_cache(self.model, num_blocks, bs)
        capacity = (num_blocks - 1) * bs
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings, capacity
        )
        # (prefill tokens, decoding sequences, seconds) of recent steps: cost-model samples
        self.step_times: deque[tuple[int, int, float]] = deque(maxlen=512)
        self.steps_recorded = 0  # appended to step_times ever (its length stops at 512)
        # true for a step that ran on the cores of idle workers (engine/core_share.py): not a
        # sample, since the predictions it feeds (TTFT, lending, admission) matter under load,
        # when every worker is on its share
        self.wide_step: Callable[[], bool] | None = None
        self.compute_seconds = 0.0  # of every step, wide or not
        self.decode_meter = DecodeMeter(self.model, known_limits())
        self.namespace = kv_namespace(
            self.model.fingerprint(self.loaded.fingerprint),
            dtype=self.model.kv_format,
            block_size=bs,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
        )
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, bs, namespace_seed(self.namespace))
        self.connector = connector or NoopConnector()
        self.connector.bind(self.kv_cache, bs, self.namespace)
        self.costs = StepCosts(self.step_times, lambda: self.scheduler.stats.steps,
                               lambda: len(self.scheduler.running))  # fmt: skip
        self.connector.set_cost_model(self.costs.prefill_s, self.costs.step_s)
        sched = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                config.kv_load_timeout_s)  # fmt: skip
        self.scheduler = Scheduler(sched, self.kv_manager, self.connector)
        kernels = paged_kernels() if config.use_kernels else None
        self.runner = ModelRunner(self.model, self.kv_cache, bs, kernels)
        self.loads_in_flight = LoadsInFlight(kernels)  # steps while KV loads are in flight
        self.output = OutputProcessor(self.tokenizer, mc.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}  # by request id (a request's first sequence)
        self._child_ids: set[str] = set()  # ids reserved for the other sequences of requests
        self._saving: dict[int, int] = {}  # block id -> references held for connector saves
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.load_stall_seconds = 0.0  # steps with nothing to run while prefixes were loading
        self.status = EngineStatus()  # replaced (never changed) by the engine thread: publish()
        logger.info(
            "engine ready in %.1fs: %s, %s, %d KV blocks x %d tokens (%.0f MiB), max_model_len %d",
            time.perf_counter() - t0,
            mc.name,
            config.dtype,
            num_blocks,
            bs,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            self.max_model_len,
        )

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text or a list of ids (BadRequestError for what cannot fit)."""
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        check_token_ids(ids, self.model_config.vocab_size, self.max_model_len)
        return ids

    def check_prompt_chars(self, num_chars: int) -> None:
        check_prompt_chars(num_chars, self.max_model_len, self.tokenizer.max_token_chars)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        kv_handle: object = None,
        prompt_hashes: list[bytes] | None = None,
    ) -> Request:
        """Queue a request; raises BadRequestError if it can never be served. ``kv_handle``:
        where a prefill worker holds the prompt's KV (``protocol.decode.KVHandle``; the
        connector may read it from there). With ``params.n`` > 1 its sequences get the ids
        ``child_id(request_id, i)``, reserved from now on. ``prompt_hashes``: what
        ``request_arrived`` returned when the caller already passed it the prompt (the leading
        block hashes, not computed again); None: this call passes it."""
        params = params or SamplingParams()
        children = [child_id(request_id, i) for i in range(1, params.n)]
        if any(r in self.requests or r in self._child_ids for r in [request_id, *children]):
            raise BadRequestError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        self.check_length(len(ids), params)
        req = Request(
            request_id, ids, params, prompt if isinstance(prompt, str) else None, arrival_time
        )
        req.kv_handle = kv_handle
        if prompt_hashes is None and kv_handle is None:
            prompt_hashes = self.request_arrived(ids)
        if prompt_hashes:
            req.block_hashes.extend(prompt_hashes)
        self.output.start(req)
        self.requests[request_id] = req
        self._child_ids.update(children)
        self.scheduler.add(req)
        self.prompt_tokens += len(ids)
        self.publish()
        return req

    def request_arrived(self, token_ids: list[int]) -> list[bytes]:
        """Hand a received prompt's block hashes to the connector (any thread), so its pool
        lookup runs while the request waits for the engine thread and the scheduler; the
        hashes (of the full blocks before the last token; none if the connector does not
        want them), for ``add_request(prompt_hashes=...)``."""
        if type(self.connector).request_arrived is KVConnector.request_arrived:
            return []  # this connector does nothing with it: no hashing
        bs = self.kv_manager.block_size
        n = (len(token_ids) - 1) // bs
        if n <= 0:
            return []
        hashes = block_hashes(token_ids[: n * bs], bs, self.kv_manager.hash_seed)
        self.connector.request_arrived(hashes)
        return hashes

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Reject prompts (plus requested output) longer than the model or cache can hold."""
        check_context_length(num_prompt_tokens, params.max_tokens, self.max_model_len)

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request (every sequence of it) and free its blocks; returns its final output
        (finish_reason abort for the sequences that had not finished)."""
        req = self.requests.get(request_id)
        if req is None:
            raise NotFoundError(f"no request {request_id!r}")
        if not req.is_finished and req.fork_pending:
            req.finish_reason = req.finish_reason or "abort"  # the sequences never forked too
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = seq.finish_reason or "abort"
                self._finish(seq)
        self._end_group(req)
        self.publish()
        return self.output.make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Requests to run, or background loads to collect (an aborted request's, say)."""
        return bool(self.requests) or self.scheduler.has_work()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample; outputs of requests that produced a token.
        Publishes a fresh ``status`` after it."""
        try:
            return self._step()
        finally:
            self.publish()

    def publish(self) -> EngineStatus:
        """A frozen snapshot of the queues (call on the engine thread; readers anywhere)."""
        sched = self.scheduler
        waiting, running = list(sched.waiting), sched.running
        queued = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        queued += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in running)
        queued += sum(ld.req.num_tokens - ld.req.num_computed_tokens
                      for ld in sched.loading.values())  # fmt: skip
        remaining = tuple(max(0, (r.params.max_tokens or 256) - len(r.output_token_ids))
                          for r in running[:MAX_REMAINING])  # fmt: skip
        self.status = EngineStatus(sched.stats.steps, queued, len(running),
                                   len(waiting) + len(sched.loading), len(sched.loading),
                                   self.pool.usage(), remaining)  # fmt: skip
        return self.status

    def _step(self) -> list[RequestOutput]:
        self._release_saved()
        sched = self.scheduler.schedule()
        if not sched.chunks:
            if self.scheduler.has_work():  # everything waits for the pool: sleep until it answers
                t0 = time.perf_counter()
                self.connector.wait_for_events(0.005)
                if self.scheduler.loading:
                    self.load_stall_seconds += time.perf_counter() - t0
            return []
        self.loads_in_flight.before_step(bool(self.scheduler.loading))
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(sched.chunks, sched.copies)
        except BaseException:
            self.kv_manager.forget(sched.new_blocks)  # their KV was never written
            raise
        decodes = sum(1 for c in sched.chunks if c.start >= c.request.num_prompt_tokens)
        prefill = sched.num_tokens - decodes
        took = time.perf_counter() - t0
        self.compute_seconds += took
        if self.wide_step is None or not self.wide_step():
            self.step_times.append((prefill, decodes, took))
            self.steps_recorded += 1
        if prefill == 0:  # a step of decodes only: what it read, over how long it took
            self.decode_meter.observe(decodes, sum(c.start + 1 for c in sched.chunks), took)
        self._save(sched.new_blocks)
        now = time.monotonic()
        groups: dict[str, Request] = {}  # requests with new tokens, in order
        samples = iter(result.samples)
        for i, ch in enumerate(sched.chunks):
            req = ch.request
            req.num_computed_tokens = ch.start + ch.num_tokens
            if i in result.prompt_logprobs:
                req.set_prompt_logprobs(ch.start + 1, result.prompt_logprobs[i])
            if not ch.completes:
                continue
            self.output.prompt_computed(req)
            sampled = next(samples)
            seqs = self._fork(req) if len(sampled.tokens) > 1 else [req]
            lps = sampled.logprobs or [None] * len(seqs)
            for seq, token, lp in zip(seqs, sampled.tokens, lps, strict=True):
                self.generation_tokens += 1
                self.output.append(seq, token, now, lp)
                if seq.finish_reason is not None:
                    self._finish(seq)
            groups[req.group.request_id] = req.group
        return [self.output.make_output(g) for g in groups.values()]

    def _fork(self, req: Request) -> list[Request]:
        """``req``'s prompt is computed: it becomes ``n`` sequences sharing its blocks."""
        seqs = [req]
        for i in range(1, req.params.n):
            child = req.fork(i, child_id(req.request_id, i))
            self.kv_manager.fork(req, child)
            self.output.start(child)
            self.scheduler.add_forked(child)
            seqs.append(child)
        return seqs

    def _finish(self, seq: Request) -> None:
        seq.status = RequestStatus.FINISHED
        self.connector.request_done(seq)  # its blocks are still its own
        self.scheduler.finish(seq)
        group = seq.group
        if group.group_finished():
            self._end_group(group)

    def _end_group(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._child_ids.difference_update(child_id(req.request_id, i)
                                          for i in range(1, req.params.n))  # fmt: skip

    def _save(self, refs: list[BlockRef]) -> None:
        if not refs or not self.connector.saves:
            return
        blocks = [self.pool.blocks[r.block_id] for r in refs]
        self.pool.touch(blocks)  # keep the bytes until the connector has copied them
        for r in refs:
            self._saving[r.block_id] = self._saving.get(r.block_id, 0) + 1
        self.connector.save(refs)

    def _release_saved(self) -> None:
        if not self._saving:
            return
        for block_id in self.connector.poll_saved():
            if self._saving.get(block_id, 0) > 0:
                self._saving[block_id] -= 1
                if not self._saving[block_id]:
                    del self._saving[block_id]
                self.pool.free([self.pool.blocks[block_id]])

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        f = self.connector.fetch_stats()
        fetch = {} if f is None else {
            "kv_fetch_loads": f.loads, "kv_fetch_recomputes": f.recomputes,
            "kv_fetch_skipped": f.skipped_lookups, "kv_fetch_ties": f.ties,
            "kv_fetch_predicted_seconds": f.predicted_load_seconds,
            "kv_fetch_realized_seconds": f.realized_load_seconds,
        }  # fmt: skip
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.pool.usage(),
            num_kv_blocks=self.pool.num_blocks,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits + s.external_hits,
            external_prefix_hits=s.external_hits,
            num_preemptions=s.preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            steps=s.steps,
            decode=self.decode_meter.figures,
            **fetch,
        )

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of every cached block no request holds; returns how many. Blocks
        whose saves have finished are let go first (until the next step they are still held
        for the saver, and a reset right after ``wait_saved`` would keep them)."""
        self._release_saved()
        return self.pool.reset_cache()

    def close(self) -> None:
        self.connector.close()
        self.loads_in_flight.leave_core(False)  # torch's threads as they were


def child_id(request_id: str, index: int) -> str:
    """The engine's id of sequence ``index`` > 0 of request ``request_id``."""
    return f"{request_id}#{index}"


__all__ = ["EngineStats", "LLMEngine", "ScheduledChunk", "child_id"]

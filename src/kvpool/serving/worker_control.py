"""A worker's control API (the project's RPC): load and cache reports, and the prefill hand-off.

``status(since)`` is what the conductor polls: the worker's role and addresses, its load
(queued prefill tokens, running decodes with their remaining tokens, KV usage), the cost model
fitted to its measured steps, its counters, and the block events (stored/removed hashes) after
event ``since`` -- or a full snapshot of its cached hashes when those events are gone.

``prefill(request_id, token_ids)`` runs a prompt through the engine (one output token), waits
until every full block of it is in the pool, and returns: the decode worker can then load them.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvpool.common.errors import BadRequestError, KVPoolError, KVPoolTimeoutError
from kvpool.common.hashing import block_hashes
from kvpool.common.rpc import rpc_method
from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.step_model import StepModel
from kvpool.protocol.worker import KVEvent, WorkerStatus

logger = logging.getLogger(__name__)


class WorkerControl:
    """RPC handler of one worker process (methods run on the RPC server's thread pool)."""

    def __init__(self, info: dict, aeng: AsyncLLMEngine, loop: asyncio.AbstractEventLoop,
                 connector=None) -> None:  # fmt: skip
        self.info = info  # id, role, http, rpc, model, pid
        self.aeng = aeng
        self.loop = loop
        self.connector = connector
        eng = aeng.engine
        self.step_model = StepModel(eng.step_times)
        self.started = time.time()

    # -- status ----------------------------------------------------------------------------

    @rpc_method
    def status(self, since: int = 0) -> dict:
        eng = self.aeng.engine
        seq = eng.pool.event_seq  # first: the events read next cover at least up to here
        events = eng.pool.events_since(int(since))
        snapshot = None
        if events is None or since <= 0:
            snapshot, events = tuple(eng.pool.cached_hashes()), []
        return WorkerStatus(
            **{k: self.info[k] for k in ("id", "role", "http", "rpc", "model", "pid")},
            alive=self.aeng.is_alive(), namespace=eng.namespace, block_size=eng.block_size,
            block_bytes=int(eng.kv_cache[0].numel() * eng.kv_cache.element_size()),
            max_model_len=eng.max_model_len, vocab_size=eng.model_config.vocab_size,
            load=eng.status, cost=self.step_model.fit(), counters=self._counters(),
            event_seq=max(seq, events[-1].seq if events else 0),
            events=tuple(KVEvent(e.seq, e.kind, e.block_hash) for e in events),
            snapshot=snapshot, step_tokens=eng.config.max_num_batched_tokens,
        ).to_wire()  # fmt: skip

    def _counters(self) -> dict:
        eng = self.aeng.engine
        st = eng.stats()
        out = {
            "prompt_tokens": st.prompt_tokens,
            "generation_tokens": st.generation_tokens,
            "prefix_queries": st.prefix_cache_queries,
            "prefix_hits_local": st.prefix_cache_hits - st.external_prefix_hits,
            "prefix_hits_pool": st.external_prefix_hits,
            "preemptions": st.num_preemptions,
            "local_evictions": eng.pool.stats.evictions,
            "compute_seconds": eng.compute_seconds,
            "steps": st.steps,
        }
        if self.connector is not None:
            c, direct = self.connector.stats, getattr(self.connector, "direct", None)
            out.update(
                pool_loaded_bytes=c.loaded_bytes,
                pool_saved_bytes=c.saved_bytes,
                pool_load_seconds=c.load_seconds,
                pool_save_seconds=c.save_seconds,
                pool_save_wait_seconds=c.save_wait_seconds,
                pool_errors=c.pool_errors,
                direct_read_bytes=direct.read_bytes if direct is not None else 0,
                direct_fallbacks=direct.fallbacks if direct is not None else 0,
                direct_tail_reads=direct.tail_reads if direct is not None else 0,
                direct_tail_misses=direct.tail_misses if direct is not None else 0,
                pool_up=self.connector.pool_up(),
            )
        return out

    @rpc_method
    def health(self) -> dict:
        return {"ok": self.aeng.is_alive(), "id": self.info["id"]}

    # -- prefill hand-off -------------------------------------------------------------------

    @rpc_method(bulk=True)
    def prefill(self, request_id: str, token_ids: list, timeout: float = 120.0) -> dict:
        """Compute the prompt's KV (and its first token); return once its blocks are pooled."""
        if not isinstance(request_id, str) or not request_id:
            raise BadRequestError("request_id must be a non-empty string")
        if not isinstance(token_ids, list) or not token_ids:
            raise BadRequestError("token_ids must be a non-empty list", param="token_ids")
        eng = self.aeng.engine
        eng.tokenize(token_ids)  # the checks of a request (400s), before anything is queued
        eng.check_length(len(token_ids), SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        conn = self.connector
        if conn is not None and conn.saves:
            conn.expect_tail(request_id)  # its partial last block goes in the handle too
        future = asyncio.run_coroutine_threadsafe(self._prefill(request_id, token_ids),
                                                  self.loop)  # fmt: skip
        try:
            final = future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise KVPoolTimeoutError(f"prefill of {request_id} took over {timeout}s") from None
        finally:
            tail = conn.take_tail(request_id) if conn is not None and conn.saves else None
        saved, handle = True, None
        if conn is not None and conn.saves:
            hashes = block_hashes(token_ids, eng.block_size, eng.kv_manager.hash_seed)
            saved = conn.wait_saved(hashes, max(1.0, timeout - (time.perf_counter() - t0)))
            handle = conn.kv_handle(hashes, tail)  # the decode side may read them from us
        return {
            "kv_handle": handle.to_wire() if handle is not None else None,
            "prompt_tokens": len(token_ids),
            "cached_tokens": final.num_cached_tokens,
            "first_token": final.outputs[0].token_ids[:1],
            "seconds": time.perf_counter() - t0,
            "saved": saved,
        }

    async def _prefill(self, request_id: str, token_ids: list):
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        last = None
        async for out in self.aeng.generate(token_ids, params, request_id):
            last = out
        if last is None or last.error is not None:
            raise KVPoolError(f"prefill of {request_id} failed: {last and last.error}")
        return last

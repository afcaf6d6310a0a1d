"""Runs an LLMEngine on a background thread and streams outputs to asyncio callers."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvpool.common.errors import KVPoolError
from kvpool.engine.core_share import CoreLedger
from kvpool.engine.llm_engine import EngineStats, LLMEngine
from kvpool.engine.request import CompletionOutput, RequestOutput
from kvpool.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    kv_handle: object = None
    prompt_hashes: list[bytes] | None = None  # from request_arrived (None: with a KV handle)


@dataclass(slots=True)
class _Abort:
    request_id: str


class EngineDeadError(KVPoolError):
    http_status = 503
    error_type = "engine_dead_error"


class AsyncLLMEngine:
    """Thread-owned engine; ``generate`` is an async iterator of cumulative RequestOutputs."""

    def __init__(self, engine: LLMEngine, cores: CoreLedger | None = None) -> None:
        self.engine = engine
        self.cores = cores  # the host's cores, shared with its other workers (core_share.py)
        if cores is not None:
            engine.wide_step = lambda: cores.step_wide  # not a cost-model sample
            # the ledger narrows steps during loads
            engine.loads_in_flight.reserve_threads = cores.leave
            cores.attach(engine.model)  # asked again between the layers of a step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Add] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvpool-engine", daemon=True)

    def start(self) -> AsyncLLMEngine:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self.engine.close()
        if self.cores is not None:
            self.cores.close()

    def stats(self) -> EngineStats:
        """The engine's stats, with the threads its steps ran on."""
        s = self.engine.stats()
        if self.cores is not None:
            s.threads, s.widened_steps = self.cores.threads, self.cores.widened_steps
        return s

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        kv_handle: object = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request, then yield its outputs until it finishes.

        Raises BadRequestError before anything is queued if the request can never be served.
        Closing the iterator early (e.g. a client disconnect) aborts the request.
        """
        if not self.is_alive():
            raise EngineDeadError("the engine thread is not running")
        rid = request_id or uuid.uuid4().hex
        ids = self.engine.tokenize(prompt)
        self.engine.check_length(len(ids), params)
        hashes = None
        if kv_handle is None:  # the pool lookup starts while the request waits for the engine
            hashes = self.engine.request_arrived(ids)
        sink: asyncio.Queue = asyncio.Queue()
        text = prompt if isinstance(prompt, str) else None
        self._inbox.put(_Add(rid, ids, text, params, sink, asyncio.get_running_loop(), kv_handle,
                             hashes))  # fmt: skip
        finished = False
        try:
            while True:
                out = await sink.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(rid))

    # -- engine thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            busy = eng.has_work()
            if not busy and self.cores is not None:
                self.cores.idle()
            self._drain(block=not busy)
            if not eng.has_work():
                continue
            if self.cores is not None:
                self.cores.begin_step()
            try:
                outs = eng.step()
            except Exception as e:  # a bug or OOM in one step must not kill the server silently
                logger.exception("engine step failed; failing its requests")
                self._fail_all(e)
                continue
            for out in outs:
                self._deliver(out)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: _Add | _Abort) -> None:
        if isinstance(item, _Abort):
            if item.request_id in self.engine.requests:
                self.engine.abort_request(item.request_id)
            self._sinks.pop(item.request_id, None)
            return
        try:
            self.engine.add_request(item.request_id, item.token_ids, item.params,
                                    kv_handle=item.kv_handle,
                                    prompt_hashes=item.prompt_hashes or [])  # fmt: skip
        except Exception as e:
            item.loop.call_soon_threadsafe(item.sink.put_nowait, e)
            return
        self.engine.requests[item.request_id].prompt = item.prompt
        self._sinks[item.request_id] = item

    def _deliver(self, out: RequestOutput) -> None:
        add = self._sinks.get(out.request_id)
        if add is None:
            return
        if out.finished:
            del self._sinks[out.request_id]
        add.loop.call_soon_threadsafe(add.sink.put_nowait, out)

    def _fail_all(self, err: Exception) -> None:
        for rid in list(self._sinks):
            add = self._sinks.pop(rid)
            if rid in self.engine.requests:
                out = self.engine.abort_request(rid)
            else:
                outs = [CompletionOutput(i, "", []) for i in range(add.params.n)]
                out = RequestOutput(rid, add.prompt, add.token_ids, outs, True)
            for o in out.outputs:
                o.finish_reason = "error"
            out.error = f"engine step failed: {err}"
            add.loop.call_soon_threadsafe(add.sink.put_nowait, out)

"""The HTTP layer's view of an AsyncLLMEngine: validation up front, liveness, guarded streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from kvpool.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvpool.engine.llm_engine import LLMEngine
from kvpool.engine.request import RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.serving.metrics import ServerMetrics

logger = logging.getLogger(__name__)


def engine_alive(aeng: AsyncLLMEngine) -> bool:
    """True while the engine thread runs."""
    return aeng.is_alive()


class EngineClient:
    """Wraps ``AsyncLLMEngine.generate`` so that a request never waits on a dead engine and its
    metrics are recorded when it ends, however it ends."""

    def __init__(
        self, aeng: AsyncLLMEngine, metrics: ServerMetrics, poll_interval: float = 1.0
    ) -> None:
        self.aeng = aeng
        self.metrics = metrics
        self.poll_interval = poll_interval

    @property
    def engine(self) -> LLMEngine:
        return self.aeng.engine

    def alive(self) -> bool:
        return engine_alive(self.aeng)

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of ``prompt``; raises before anything is queued if it cannot be served."""
        if not self.alive():
            raise EngineDeadError("the engine is not running")
        ids = self.engine.tokenize(prompt)
        self.engine.check_length(len(ids), params)
        return ids

    async def generate(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        kv_handle=None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request. Closing the iterator early aborts the request.
        ``kv_handle``: where a prefill worker holds the prompt's KV (a direct read)."""
        gen = self.aeng.generate(ids, params, request_id or uuid.uuid4().hex, kv_handle)
        pending: asyncio.Future | None = None
        final: RequestOutput | None = None
        try:
            while final is None:
                pending = asyncio.ensure_future(anext(gen))
                out = await self._wait(pending)
                pending = None
                if out.finished:
                    final = out
                yield out
        except StopAsyncIteration:
            return
        finally:
            if pending is not None and not pending.done():
                pending.cancel()  # raises inside the engine's generator, which aborts the request
                with contextlib.suppress(BaseException):
                    await pending
            await gen.aclose()
            self._record(final)

    async def _wait(self, pending: asyncio.Future) -> RequestOutput:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=self.poll_interval)
            if done:
                return pending.result()
            if not self.alive():
                raise EngineDeadError("the engine stopped while serving this request")

    def _record(self, final: RequestOutput | None) -> None:
        try:
            if final is None:
                self.metrics.observe_aborted()
            else:
                self.metrics.observe_finished(final)
        except Exception:
            logger.exception("recording request metrics failed")

"""Answering one OpenAI request: one engine request per prompt (each with its ``n``
sequences), gathered into one JSON body, or merged into one stream whose chunks each carry
their choice's index (``prompt_index * n + i``) in the order the engine produced them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from kvpool.common.errors import KVPoolError
from kvpool.engine.request import CompletionOutput, RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.serving.engine_client import EngineClient
from kvpool.serving.formats import (
    SSE_DONE,
    ChatFormat,
    CompletionFormat,
    Delta,
    echo_text,
    finish_reason,
    sse,
)
from kvpool.serving.http_errors import error_body

logger = logging.getLogger(__name__)


class EngineError(KVPoolError):
    """The engine failed while running a request."""

    error_type = "engine_error"


@dataclass(slots=True)
class Job:
    """One OpenAI request, tokenized: its prompts, how to sample, how to answer."""

    prompts: list[list[int]]
    params: SamplingParams
    fmt: CompletionFormat | ChatFormat
    texts: Sequence[str | None] = ()  # the prompts as the client wrote them (echo)
    kv_handle: object = None  # where a prefill worker holds the (one) prompt's KV
    cached_tokens: int | None = None  # usage's cached tokens for it (the prefill's reuse)

    def request_id(self, p: int) -> str:
        return self.fmt.id if len(self.prompts) == 1 else f"{self.fmt.id}-{p}"

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n


@dataclass(slots=True)
class _Choice:
    """What a stream has sent of one choice."""

    index: int
    text: int = 0  # characters of the answer's text
    tokens: int = 0  # tokens whose logprobs went out
    offset: int = 0  # characters in all (``text_offset`` of the next token)
    echoed: bool = False
    done: bool = False


class Responder:
    """Runs jobs on one engine (``EngineClient``)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def _generate(self, job: Job, p: int) -> AsyncIterator[RequestOutput]:
        return self.client.generate(job.prompts[p], job.params, job.request_id(p),
                                    job.kv_handle if p == 0 else None)  # fmt: skip

    @staticmethod
    def _as_asked(job: Job, p: int, out: RequestOutput) -> RequestOutput:
        if p < len(job.texts) and job.texts[p] is not None:
            out.prompt = job.texts[p]
        if p == 0 and job.cached_tokens is not None:
            out.num_cached_tokens = job.cached_tokens
        return out

    # -- one JSON body ----------------------------------------------------------------------

    async def finals(self, job: Job) -> list[RequestOutput]:
        """The final output of every prompt, in order; the first failure cancels the rest."""
        tasks = [asyncio.ensure_future(self._final(job, p)) for p in range(len(job.prompts))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:  # the failure, not the cancellations it caused
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]

    async def _final(self, job: Job, p: int) -> RequestOutput:
        last = None
        async for out in self._generate(job, p):
            last = out
        assert last is not None
        if last.error is not None:
            raise EngineError(last.error)
        return self._as_asked(job, p, last)

    # -- a stream ---------------------------------------------------------------------------

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """SSE events: opening chunks, each choice's deltas, its finish, usage, ``[DONE]``."""
        fmt = job.fmt
        # Text that may still turn out to start a stop string is held back until it cannot.
        hold = max((len(s) for s in job.params.stop_strings), default=1) - 1
        n = job.params.n
        states = [_Choice(i) for i in range(job.num_choices)]
        finals: dict[int, RequestOutput] = {}
        if not fmt.opts.sent:  # else the conductor sent them with the first token
            for chunk in fmt.first_chunks(job.num_choices):
                yield sse(chunk)
        # closed here, not left to the garbage collector: a client gone at a yield below
        # closes this generator there, and only ``merged``'s own close aborts the requests
        outs = merged([self._generate(job, p) for p in range(len(job.prompts))])
        try:
            async for p, out in outs:
                if out.error is not None:
                    yield sse(error_body(500, out.error, EngineError.error_type))
                    return
                self._as_asked(job, p, out)
                for o in out.outputs:
                    for chunk in self._deltas(fmt, hold, states[p * n + o.index], out, o):
                        yield sse(chunk)
                if out.finished:
                    finals[p] = out
            if fmt.include_usage:
                yield sse(fmt.usage_chunk([finals[p] for p in sorted(finals)]))
            yield SSE_DONE
        except KVPoolError as exc:
            logger.warning("stream failed: %s", exc.message)
            yield sse(exc.to_openai())
        except Exception:
            logger.exception("stream failed")
            yield sse(error_body(500, "internal server error"))
        finally:
            await outs.aclose()

    @staticmethod
    def _deltas(fmt: CompletionFormat | ChatFormat, hold: int, st: _Choice,
                out: RequestOutput, o: CompletionOutput) -> list[dict]:  # fmt: skip
        """The chunks of what ``o`` adds to what choice ``st`` has sent."""
        if st.done:
            return []
        finished = o.finish_reason is not None
        opts = fmt.opts
        if opts.prompt_only:
            if not finished:
                return []
            o = CompletionOutput(o.index, "", [], "length", None,
                                 None if o.logprobs is None else [])  # fmt: skip
        end = len(o.text) if finished else max(st.text, len(o.text) - hold)
        text, ids = o.text[st.text : end], list(o.token_ids[st.tokens :])
        lps = None if o.logprobs is None else list(o.logprobs[st.tokens :])
        if opts.echo and not st.echoed:
            text = echo_text(fmt, out) + text
            ids = [*out.prompt_token_ids, *ids]
            if lps is not None:
                lps = [*(out.prompt_logprobs or [None] * len(out.prompt_token_ids)), *lps]
        delta = Delta(st.index, text, ids if lps is not None else (), lps,
                      finish_reason(o) if finished else None, st.offset)  # fmt: skip
        chunks = fmt.delta_chunks(delta)
        if chunks:
            st.text, st.tokens, st.echoed, st.done = end, len(o.token_ids), True, finished
            st.offset += len(text)
        return chunks


async def merged(
    gens: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, item) of several async iterators as they come; closing it closes them all
    (which aborts their engine requests)."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, end, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(gens)
        while live:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is end:
                live -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            with contextlib.suppress(BaseException):
                await g.aclose()  # type: ignore[attr-defined]

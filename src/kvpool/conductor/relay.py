"""Relaying a decode worker's answer to the client, with the request's place in flight.

A ``Flight`` is one admitted request: it holds its slot in the conductor's in-flight count and
its decode worker's, and gives both back exactly once, however the request ends (finished,
failed, the client gone before the first byte or mid-stream). Streams use ``RelayResponse``,
which releases the flight even when the stream's generator never ran; a non-streaming relay
stops (and so aborts the worker's request) when its client disconnects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpool.common.errors import KVPoolError
from kvpool.serving.formats import sse
from kvpool.serving.http_errors import error_body
from kvpool.serving.openai_app import wait_disconnect

logger = logging.getLogger(__name__)
JSON = {"Content-Type": "application/json"}


class WorkerFailedError(KVPoolError):
    http_status = 502
    error_type = "worker_error"


class Flight:
    """One request in flight; ``release`` (idempotent) ends it with ``outcome``."""

    def __init__(self, release: Callable[[str], None]) -> None:
        self._release: Callable[[str], None] | None = release
        self._also: list[Callable[[], None]] = []
        self.outcome = "aborted"  # until the relay says otherwise

    def also(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Runs ``fn`` at the release too (``fn`` may have run before; returns it)."""
        self._also.append(fn)
        return fn

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release(self.outcome)
            for fn in self._also:
                fn()

    @property
    def released(self) -> bool:
        return self._release is None


def queue_on(w, tokens: int) -> Callable[[], None]:
    """Counts ``tokens`` prompt tokens in worker ``w``'s queue (its ``pending_tokens``) until
    the returned callable is called (again: nothing)."""
    if w is None or tokens <= 0:
        return lambda: None
    w.pending_tokens += tokens
    done = [False]

    def release() -> None:
        if not done[0]:
            done[0] = True
            w.pending_tokens -= tokens

    return release


class RelayResponse(StreamingResponse):
    """A stream that releases its flight and closes its generator whatever happens (a client
    gone before the first chunk means the generator never started, so its own cleanup would
    never run)."""

    def __init__(self, content: AsyncIterator[bytes], flight: Flight) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        self.flight = flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.release()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class Relay:
    """Posts a request to a decode worker and relays its answer (``metrics``: the conductor's,
    ``failed(worker_id)``: called when the worker, not the client, broke the request)."""

    def __init__(self, http: httpx.AsyncClient, metrics, failed: Callable[[str], None]) -> None:
        self.http, self.metrics, self.failed = http, metrics, failed

    async def json(self, request: Request, url: str, body: bytes, worker: str, t0: float,
                   flight: Flight, headers: dict | None = None) -> Response:  # fmt: skip
        post = asyncio.ensure_future(self.http.post(url, content=body, headers=headers or JSON))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({post, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not post.done():  # the client left: closing our connection aborts the worker's
                post.cancel()
                await asyncio.gather(post, return_exceptions=True)
        if post.cancelled():
            logger.info("client disconnected; request on %s aborted", worker)
            return Response(status_code=499)
        try:
            resp = post.result()
        except httpx.HTTPError as exc:
            self.failed(worker)
            flight.outcome = "error"
            raise WorkerFailedError(f"worker {worker} failed ({type(exc).__name__})") from None
        flight.outcome = "ok" if resp.status_code == 200 else "error"
        content = resp.content
        if resp.status_code == 200:
            self.metrics.e2e.observe(time.perf_counter() - t0)
        return Response(content, resp.status_code, media_type="application/json")

    async def stream(self, url: str, body: bytes, worker: str, t0: float, flight: Flight,
                     opening: list[str] = (), headers: dict | None = None,
                     on_first: Callable[[], None] | None = None) -> AsyncIterator[bytes]:  # fmt: skip
        """``opening``: chunks sent before the worker's (the first token, from the prefill);
        ``on_first``: called once, at the first token (or when the stream ends without one)."""
        first = last = None
        chunks = 0
        flight.outcome = "error"
        try:
            if opening:
                first = last = time.perf_counter()
                self.metrics.ttft.observe(first - t0)
                chunks = sum(1 for c in opening if c.startswith("data: "))
                yield "".join(opening).encode()
            resp = await self.http.send(self.http.build_request(
                "POST", url, content=body, headers=headers or JSON), stream=True)  # fmt: skip
            try:
                if resp.status_code != 200:
                    data = await resp.aread()
                    yield sse(_error_of(resp.status_code, data)).encode()
                    return
                async for part in resp.aiter_raw():
                    now = time.perf_counter()
                    n = part.count(b"data: ") - part.count(b"data: [DONE]")
                    if n:
                        if first is None:
                            first = now
                            self.metrics.ttft.observe(now - t0)
                            if on_first is not None:
                                on_first()
                                on_first = None
                        elif last is not None:
                            self.metrics.itl.observe(now - last)
                        last, chunks = now, chunks + n
                    yield part
                flight.outcome = "ok"
            finally:
                await resp.aclose()
        except httpx.HTTPError as exc:
            logger.warning("stream from %s broke: %s", worker, exc)
            self.failed(worker)
            yield sse(error_body(502, f"worker {worker} failed mid-stream: "
                                      f"{type(exc).__name__}", WorkerFailedError.error_type)).encode()  # fmt: skip
        finally:
            if on_first is not None:
                on_first()
            flight.release()
            if flight.outcome == "ok" and last is not None:
                self.metrics.e2e.observe(last - t0)
                if first is not None and chunks > 1:
                    self.metrics.tpot.observe((last - first) / (chunks - 1))


def _error_of(status: int, data: bytes) -> dict:
    """A worker's error answer as an OpenAI error (its own JSON body, else a generic one)."""
    try:
        body = json.loads(data)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return body
    except ValueError:
        pass
    return error_body(status, f"the worker answered HTTP {status}")

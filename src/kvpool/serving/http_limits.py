"""Limits before work for kvpool's HTTP servers (the OpenAI API of the conductor and workers).

- ``BodyLimitMiddleware``: a body over ``max_body_bytes`` gets 413 (from ``Content-Length``
  before anything is read, or as soon as the streamed body passes it), a body that does not
  arrive within ``body_timeout`` gets 408;
- ``header_timeout_protocol``: uvicorn's h11 protocol, closing a connection that has not sent
  its request headers within ``header_timeout`` (slow-header clients), which uvicorn itself
  does not bound;
- ``serve_http``: uvicorn with the header timeout and ``limit_concurrency`` (503 beyond it),
  started once what the process built at start-up is frozen out of the garbage collector's
  reach (``freeze_startup_heap``); ``install_limits`` adds the body limits to an app.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpool.common.errors import KVPoolError, PayloadTooLargeError
from kvpool.config import HttpLimits

logger = logging.getLogger(__name__)

__all__ = ["HttpLimits", "freeze_startup_heap", "install_limits", "serve_http"]


class BodyTimeoutError(KVPoolError):
    http_status = 408
    error_type = "timeout_error"


async def _send_error(send: Send, exc: KVPoolError) -> None:
    raw = json.dumps(exc.to_openai()).encode()
    await send({"type": "http.response.start", "status": exc.http_status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(raw)).encode()),
                            (b"connection", b"close")]})  # fmt: skip
    await send({"type": "http.response.body", "body": raw})


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``, 408 for bodies slower than ``timeout`` seconds. The
    streamed check raises inside ``receive``: the route's ``await request.body()`` turns it into
    the JSON error through the app's KVPoolError handler."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_error(send, PayloadTooLargeError("invalid Content-Length"))
                return
            if int(declared) > self.max_bytes:
                await _send_error(send, self._too_large())
                return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        received, complete = 0, False

        async def limited() -> Message:
            nonlocal received, complete
            if complete:  # the body is in: what follows is the wait for a disconnect
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.001))
            except TimeoutError:
                raise BodyTimeoutError(
                    f"the request body did not arrive within {self.timeout:g} s"
                ) from None
            if message["type"] != "http.request":
                complete = True
                return message
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self._too_large()
            complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"the request body is over {self.max_bytes} bytes (--max-body-bytes)"
        )


def install_limits(app, limits: HttpLimits | None) -> None:
    """Add the body limits to a FastAPI/Starlette ``app`` (default limits when None)."""
    limits = limits or HttpLimits()
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(limits.max_body_bytes),
                       timeout=limits.body_timeout)  # fmt: skip


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on request headers: armed when the connection
    opens and after each response, disarmed when a request's headers are complete."""

    class HeaderTimeoutProtocol(H11Protocol):
        header_timeout = seconds
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # before: a pipelined request may start inside
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _expired(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                logger.info("closing a connection that sent no request headers in %.0f s",
                            self.header_timeout)  # fmt: skip
                self.transport.close()

    return HeaderTimeoutProtocol


def freeze_startup_heap() -> int:
    """Collect once, then move every object still alive (a loaded model, its tokenizer's
    tables, the app) into the collector's permanent generation, and return how many there
    are. Serving requests allocates enough to trigger full collections now and then, and each
    walked all of them: ~90 ms for a loaded engine here (187,000 objects), on the thread that
    steps the engine, which is a gap in every stream it decodes."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve_http(app: ASGIApp, limits: HttpLimits, log_level: str,
                     on_ready: Callable[[], None] | None = None, *, host: str | None = None,
                     port: int | None = None, sockets: list | None = None) -> None:  # fmt: skip
    """Run ``app`` under uvicorn with ``limits`` until it stops (Ctrl-C, SIGTERM)."""
    import uvicorn

    kwargs = {} if sockets else {"host": host, "port": port}
    config = uvicorn.Config(
        app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=3,
        limit_concurrency=limits.max_connections, timeout_keep_alive=5,
        http=header_timeout_protocol(limits.header_timeout), **kwargs,
    )  # fmt: skip
    server = uvicorn.Server(config)
    frozen = freeze_startup_heap()
    logger.debug("%d start-up objects frozen out of the garbage collector's walks", frozen)
    task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started and on_ready is not None:
        on_ready()
    await task

"""Every HTTP error in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``,
plus the bearer-token check (both as small ASGI pieces shared by kvpool's servers)."""

from __future__ import annotations

import json
import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpool.common.errors import KVPoolError, NotFoundError, RejectedError
from kvpool.serving.protocol import validation_error

logger = logging.getLogger(__name__)

_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
}


class ModelNotFoundError(NotFoundError):
    """A request named a model this server does not serve (OpenAI's ``model_not_found``)."""

    error_type = "invalid_request_error"

    def to_openai(self) -> dict:
        body = super().to_openai()
        body["error"]["code"] = "model_not_found"
        return body


def error_body(
    status: int, message: str, err_type: str | None = None, param: str | None = None
) -> dict:
    err_type = err_type or _HTTP_TYPES.get(
        status, "internal_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(exc: KVPoolError) -> JSONResponse:
    headers = None
    if isinstance(exc, RejectedError):
        headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
    return JSONResponse(exc.to_openai(), status_code=exc.http_status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Typed errors, validation errors and HTTP errors (404 route, 405) as OpenAI errors."""

    async def on_kvpool(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, KVPoolError)
        if exc.http_status >= 500:
            logger.error("request failed: %s: %s", type(exc).__name__, exc.message)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(list(exc.errors())))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        body = error_body(exc.status_code, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(KVPoolError, on_kvpool)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)


async def _send_json(send: Send, status: int, body: dict, headers: dict | None = None) -> None:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


class CatchAllMiddleware:
    """Turns an unexpected exception into a logged 500 OpenAI error instead of a bare 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            logger.info("client disconnected during %s %s", scope.get("method"), scope.get("path"))
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:  # the details are in the server's log, not for the client
                await _send_json(send, 500, error_body(500, "internal server error"))


class BearerAuthMiddleware:
    """Requires ``Authorization: Bearer <key>``, with one of ``tokens``, on every HTTP request
    but the exempt paths (each key compared in constant time)."""

    def __init__(self, app: ASGIApp, tokens: list[str],
                 exempt: tuple[str, ...] = ("/health",)) -> None:  # fmt: skip
        if not tokens:
            raise ValueError("BearerAuthMiddleware needs at least one token")
        self.app = app
        self._expected = [f"Bearer {t}".encode() for t in tokens]
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        matches = [secrets.compare_digest(given, e) for e in self._expected]  # no early exit
        if any(matches):
            await self.app(scope, receive, send)
            return
        body = error_body(401, "missing or invalid API key (Authorization: Bearer <token>)")
        await _send_json(send, 401, body, {"WWW-Authenticate": "Bearer"})

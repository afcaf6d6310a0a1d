"""The one OpenAI-compatible app of kvpool, shared by the conductor (``conductor/api.py``) and
an engine's own server (``serving/api_server.py``: ``kvpool serve --single`` and every worker).

``build_openai_app`` gives any ``OpenAIBackend`` the same routes (``/health``, ``/metrics``,
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``), error handlers and middleware
stack (errors as JSON, body limits, bearer auth); a backend adds its own routes with ``extra``
(the conductor's ``/cluster``, a worker's ``/internal/generate``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpool.config import HttpLimits
from kvpool.serving.http_errors import (
    BearerAuthMiddleware,
    CatchAllMiddleware,
    install_error_handlers,
)
from kvpool.serving.http_limits import install_limits


class OpenAIBackend(Protocol):
    """What answers the OpenAI routes: one engine, or the conductor over many."""

    def check_model(self, model: str | None) -> None: ...

    def model_card(self) -> dict: ...

    async def completions(self, request: Request) -> Response: ...

    async def chat(self, request: Request) -> Response: ...

    async def health(self) -> JSONResponse: ...

    async def metrics_response(self) -> Response: ...


def build_openai_app(backend: OpenAIBackend, title: str, summary: str,
                     api_keys: list[str] | tuple = (), limits: HttpLimits | None = None,
                     extra: Callable[[FastAPI], None] | None = None) -> FastAPI:  # fmt: skip
    """The app over ``backend``. With ``api_keys``, every request but ``/health`` needs
    ``Authorization: Bearer <one of them>``; ``limits``: body size and time limits (default
    ``HttpLimits()``); ``extra(app)`` adds the backend's own routes."""
    app = FastAPI(title=title, summary=summary)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await backend.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await backend.metrics_response()

    add_model_routes(app, backend.model_card, backend.check_model)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await backend.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await backend.chat(request)

    if extra is not None:
        extra(app)
    secure_app(app, list(api_keys), limits)
    return app


def secure_app(app: FastAPI, api_keys: list[str], limits: HttpLimits | None = None) -> None:
    """The middleware every kvpool HTTP app gets, inside out: unexpected errors as a logged
    500, body limits, and (with ``api_keys``) the bearer check, outermost."""
    app.add_middleware(CatchAllMiddleware)
    install_limits(app, limits)
    if api_keys:
        app.add_middleware(BearerAuthMiddleware, tokens=list(api_keys))


def add_model_routes(app: FastAPI, card: Callable[[], dict],
                     check: Callable[[str | None], None]) -> None:  # fmt: skip
    """``/v1/models`` and ``/v1/models/{model}`` for the one model ``card()`` describes."""

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> JSONResponse:
        check(model)
        return JSONResponse(card())


async def wait_disconnect(request: Request) -> None:
    """Return when the client of ``request`` (whose body was read) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

"""What the conductor's and a worker's OpenAI apps share: the middleware stack and the model
routes."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvpool.config import HttpLimits
from kvpool.serving.http_errors import BearerAuthMiddleware, CatchAllMiddleware
from kvpool.serving.http_limits import install_limits


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

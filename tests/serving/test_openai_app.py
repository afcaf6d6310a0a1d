"""The one OpenAI app: any backend gets the same routes, errors and auth; extras are added."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient

from kvpool.serving.http_errors import ModelNotFoundError
from kvpool.serving.openai_app import build_openai_app

OPENAI_ROUTES = {"/health", "/metrics", "/v1/models", "/v1/models/{model:path}",
                 "/v1/completions", "/v1/chat/completions"}  # fmt: skip


class Echo:
    """A backend that answers with what it was asked (a seam: the engine's and the
    conductor's apps are tested for real in test_api_server.py and the e2e tests)."""

    def check_model(self, model):
        if model != "m":
            raise ModelNotFoundError(f"no model {model!r}")

    def model_card(self):
        return {"id": "m", "object": "model"}

    async def completions(self, request: Request) -> Response:
        return JSONResponse({"route": "completions", "body": (await request.json())})

    async def chat(self, request: Request) -> Response:
        return JSONResponse({"route": "chat"})

    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def metrics_response(self) -> Response:
        return Response("m 1\n", media_type="text/plain")


def paths(app) -> set[str]:
    return {r.path for r in app.routes if not r.path.startswith(("/docs", "/openapi", "/redoc"))}


def test_same_routes_for_every_backend_and_extras_added():
    def extra(app):
        @app.get("/cluster")
        async def cluster():
            return {"workers": []}

    app = build_openai_app(Echo(), "t", "s", api_keys=["k"], extra=extra)
    assert paths(app) == OPENAI_ROUTES | {"/cluster"}
    c = TestClient(app)
    assert c.get("/health").json() == {"status": "ok"}  # no key needed
    assert c.get("/v1/models").status_code == 401
    auth = {"Authorization": "Bearer k"}
    assert c.get("/v1/models", headers=auth).json()["data"] == [{"id": "m", "object": "model"}]
    r = c.get("/v1/models/other", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["message"] == "no model 'other'"
    r = c.post("/v1/completions", json={"prompt": "x"}, headers=auth)
    assert r.json() == {"route": "completions", "body": {"prompt": "x"}}
    assert c.get("/cluster", headers=auth).json() == {"workers": []}


def test_the_engine_and_conductor_apps_are_built_by_it():
    import inspect

    from kvpool.conductor import api as conductor_api
    from kvpool.serving import api_server

    for module in (conductor_api, api_server):
        assert "build_openai_app(" in inspect.getsource(module)
        assert '@app.post("/v1/completions")' not in inspect.getsource(module)

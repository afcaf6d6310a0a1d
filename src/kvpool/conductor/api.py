"""The conductor's OpenAI-compatible front door.

A request is validated and tokenized here (same tokenizer and chat template as the workers, so
block hashes agree), its prefix is looked up in the pool, the router picks workers (or rejects
it with 429), the prefill worker computes and publishes the prompt's KV (control RPC), and the
decode worker's response -- a stream or one JSON body -- is relayed to the client unchanged.
If the prefill worker fails, the decode worker computes the prompt itself. If the decode worker
dies mid-stream, the stream ends with an error event. Routes: ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``, ``/health``, ``/metrics``, ``/cluster``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool.common.errors import BadRequestError, KVPoolError, RejectedError, UnavailableError
from kvpool.common.hashing import block_hashes, namespace_seed
from kvpool.common.rpc import RpcClient
from kvpool.conductor.cluster import ClusterState
from kvpool.conductor.cluster_state import RequestInfo
from kvpool.conductor.metrics import ConductorMetrics
from kvpool.conductor.router import Route, Router
from kvpool.serving.formats import sse
from kvpool.serving.http_errors import (
    BearerAuthMiddleware,
    CatchAllMiddleware,
    ModelNotFoundError,
    error_body,
    install_error_handlers,
)
from kvpool.serving.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from kvpool.serving.store_connector import block_key

logger = logging.getLogger(__name__)


class WorkerFailedError(KVPoolError):
    http_status = 502
    error_type = "worker_error"


class Conductor:
    """Request handling behind the routes."""

    def __init__(self, cluster: ClusterState, router: Router, tokenizer, model_name: str,
                 token: str | None = None, prefill_timeout: float = 300.0) -> None:  # fmt: skip
        self.cluster, self.router, self.tok = cluster, router, tokenizer
        self.model_name, self.token = model_name, token
        self.prefill_timeout = prefill_timeout
        self.metrics = ConductorMetrics(cluster)
        self.inflight = 0
        self.created = int(time.time())
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0, connect=3.0))

    async def close(self) -> None:
        await self.http.aclose()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"The model `{model}` does not exist (this server serves "
                                     f"`{self.model_name}`).", param="model")  # fmt: skip

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "kvpool", "root": self.model_name}  # fmt: skip

    # -- one request -----------------------------------------------------------------------

    def tokenize(self, path: str, body: bytes) -> tuple[list[int], bool, int]:
        """(token ids, stream?, max_tokens) of a completions or chat request body."""
        if path.endswith("/chat/completions"):
            req = parse_request(body, ChatCompletionRequest)
            self.check_model(req.model)
            params = req.to_sampling_params()
            if self.tok.chat_template is None:
                raise BadRequestError("this model has no chat template; use /v1/completions")
            text = self.tok.apply_chat_template(req.chat_messages(), add_generation_prompt=True)
            ids = self.tok.encode(text, add_special_tokens=False)
        else:
            req = parse_request(body, CompletionRequest)
            self.check_model(req.model)
            params = req.to_sampling_params()
            prompt = req.single_prompt()
            ids = self.tok.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) \
                else list(prompt)  # fmt: skip
        if not ids:
            raise BadRequestError("the prompt is empty", param="prompt")
        return ids, bool(req.stream), int(params.max_tokens or 16)

    def request_info(self, ids: list[int], max_tokens: int) -> RequestInfo:
        c = self.cluster
        hashes: list[bytes] = []
        if c.namespace is not None:
            usable = ids[: (len(ids) - 1) // c.block_size * c.block_size]
            hashes = block_hashes(usable, c.block_size, namespace_seed(c.namespace))
        pool = c.pool_prefix_blocks([block_key(h) for h in hashes])
        return RequestInfo(len(ids), tuple(hashes), c.block_size, max_tokens, pool)

    async def handle(self, request: Request) -> Response:
        t0 = time.perf_counter()
        body = await request.body()
        ids, stream, max_tokens = self.tokenize(request.url.path, body)
        info = await asyncio.to_thread(self.request_info, ids, max_tokens)
        try:
            route = self.router.route(self.cluster.snapshot(), info, self.inflight)
        except RejectedError as exc:
            self.metrics.rejected.labels(exc.reason).inc()
            self.metrics.requests.labels("rejected").inc()
            raise
        except UnavailableError:
            self.metrics.rejected.labels("no_worker").inc()
            self.metrics.requests.labels("unavailable").inc()
            raise
        self.inflight += 1
        decode = self.cluster.worker(route.decode.worker_id)
        if decode is not None:
            decode.inflight += 1
        cached = None  # with a prefill hand-off: the prefix the prefill worker reused
        try:
            if route.prefill is not None:
                cached = await self._prefill(route, ids)
            url = f"http://{self._http_of(route.decode.worker_id)}{request.url.path}"
            self.metrics.routed.labels(route.decode.worker_id, "decode").inc()
        except BaseException:
            self._done(route)
            raise
        if stream:
            return StreamingResponse(self._relay_stream(url, body, route, t0, cached),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            return await self._relay_json(url, body, route, t0, cached)
        finally:
            self._done(route)

    def _http_of(self, worker_id: str) -> str:
        w = self.cluster.worker(worker_id)
        if w is None or w.view is None:
            raise UnavailableError(f"worker {worker_id} is gone")
        return w.view.address

    def _done(self, route: Route) -> None:
        self.inflight -= 1
        w = self.cluster.worker(route.decode.worker_id)
        if w is not None:
            w.inflight = max(0, w.inflight - 1)

    async def _prefill(self, route: Route, ids: list[int]) -> int | None:
        """Run the prompt on the prefill worker; the prompt tokens it reused (None: failed)."""
        assert route.prefill is not None
        w = self.cluster.worker(route.prefill.worker_id)
        if w is None or w.view is None:
            return None
        self.metrics.routed.labels(w.view.id, "prefill").inc()
        rid = f"prefill-{uuid.uuid4().hex}"
        t0 = time.perf_counter()

        def call() -> dict:
            with RpcClient(w.view.rpc, token=self.token, timeout=self.prefill_timeout) as c:
                return c.call("prefill", rid, ids, self.prefill_timeout)

        try:
            result = await asyncio.to_thread(call)
            self.metrics.prefill.observe(time.perf_counter() - t0)
            return int(result["cached_tokens"])
        except KVPoolError as exc:  # the decode worker will compute the prompt itself
            logger.warning("prefill on %s failed (%s); decode computes it", w.view.id, exc)
            self.cluster.mark_failed(w.view.id)
            return None

    async def _relay_json(self, url: str, body: bytes, route: Route, t0: float,
                          cached: int | None) -> Response:  # fmt: skip
        try:
            resp = await self.http.post(url, content=body,
                                        headers={"Content-Type": "application/json"})  # fmt: skip
        except httpx.HTTPError as exc:
            self.cluster.mark_failed(route.decode.worker_id)
            self.metrics.requests.labels("error").inc()
            raise WorkerFailedError(f"worker {route.decode.worker_id} failed: {exc}") from exc
        if resp.status_code == 200:
            self.metrics.e2e.observe(time.perf_counter() - t0)
        self.metrics.requests.labels("ok" if resp.status_code == 200 else "error").inc()
        content = resp.content
        if cached is not None and resp.status_code == 200:
            content = _with_cached_tokens(content, cached)
        return Response(content, resp.status_code, media_type="application/json")

    async def _relay_stream(self, url: str, body: bytes, route: Route, t0: float,
                            cached: int | None) -> AsyncIterator[bytes]:  # fmt: skip
        first = last = None
        chunks = 0
        outcome = "error"
        try:
            req = self.http.build_request("POST", url, content=body,
                                          headers={"Content-Type": "application/json"})  # fmt: skip
            resp = await self.http.send(req, stream=True)
            try:
                if resp.status_code != 200:
                    data = await resp.aread()
                    yield sse(
                        json.loads(data)
                        if data.startswith(b"{")
                        else error_body(resp.status_code, data.decode(errors="replace"))
                    )
                    return
                async for part in resp.aiter_raw():
                    now = time.perf_counter()
                    n = part.count(b"data: ") - part.count(b"data: [DONE]")
                    if n:
                        if first is None:
                            first = now
                            self.metrics.ttft.observe(now - t0)
                        elif last is not None:
                            self.metrics.itl.observe(now - last)
                        last, chunks = now, chunks + n
                    if cached is not None and b'"usage"' in part:
                        part = _with_cached_tokens(part, cached)
                    yield part
                outcome = "ok"
            finally:
                await resp.aclose()
        except httpx.HTTPError as exc:
            logger.warning("stream from %s broke: %s", route.decode.worker_id, exc)
            self.cluster.mark_failed(route.decode.worker_id)
            yield sse(error_body(502, f"worker {route.decode.worker_id} failed mid-stream: "
                                      f"{type(exc).__name__}", WorkerFailedError.error_type))  # fmt: skip
        finally:
            self._done(route)
            self.metrics.requests.labels(outcome).inc()
            if outcome == "ok" and last is not None:
                self.metrics.e2e.observe(last - t0)
                if first is not None and chunks > 1:
                    self.metrics.tpot.observe((last - first) / (chunks - 1))


def _with_cached_tokens(data: bytes, cached: int) -> bytes:
    """Report the prefix the prefill worker reused as the request's cached tokens (the decode
    worker loaded the whole prompt from the pool, but only that part was reused, not computed
    for this request). ``data`` is a JSON body or SSE lines; anything unparsable is kept."""

    def fix(obj: dict) -> dict:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            details["cached_tokens"] = min(cached, int(usage.get("prompt_tokens", cached)))
            usage["prompt_tokens_details"] = details
        return obj

    try:
        if not data.lstrip().startswith(b"data:"):
            return json.dumps(fix(json.loads(data))).encode()
        lines = []
        for line in data.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                line = b"data: " + json.dumps(fix(json.loads(line[6:]))).encode()
            lines.append(line)
        return b"\n".join(lines)
    except (ValueError, TypeError):
        return data


def build_conductor_app(conductor: Conductor, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="kvpool conductor", summary="OpenAI-compatible, KVCache-aware")
    app.state.conductor = conductor
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        snap = conductor.cluster.snapshot()
        alive = [w.id for w in snap.workers if w.alive]
        ok = bool(alive)
        return JSONResponse({"status": "ok" if ok else "no live worker", "workers": alive,
                             "pool_up": snap.pool_up}, status_code=200 if ok else 503)  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        data = await asyncio.to_thread(conductor.metrics.render)
        return Response(data, media_type=conductor.metrics.content_type)

    @app.get("/cluster")
    async def cluster() -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(conductor.cluster.describe))

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [conductor.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> JSONResponse:
        conductor.check_model(model)
        return JSONResponse(conductor.model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await conductor.handle(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await conductor.handle(request)

    app.add_middleware(CatchAllMiddleware)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, token=api_key)
    return app

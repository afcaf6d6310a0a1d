"""The OpenAI-compatible HTTP server of a single engine.

``build_app(aeng, model_name)`` returns a FastAPI app with ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (JSON or SSE streams), ``/health`` and ``/metrics``. A client that goes
away aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpool.common.errors import BadRequestError, ForbiddenError, ProtocolError
from kvpool.config import HttpLimits
from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.engine.sampling import SamplingParams
from kvpool.protocol.decode import DecodeRequest
from kvpool.serving.engine_client import EngineClient
from kvpool.serving.formats import ChatFormat, CompletionFormat, ResponseOptions
from kvpool.serving.http_errors import ModelNotFoundError
from kvpool.serving.logprobs_format import TokenStrings
from kvpool.serving.metrics import ServerMetrics
from kvpool.serving.openai_app import build_openai_app, wait_disconnect
from kvpool.serving.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from kvpool.serving.responses import EngineError, Job, Responder

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

__all__ = ["EngineError", "OpenAIServer", "build_app"]


class _SSEResponse(StreamingResponse):
    """A stream that always closes its generator, so an early disconnect aborts the request."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class OpenAIServer:
    """Request handling behind the routes (one per app)."""

    def __init__(self, aeng: AsyncLLMEngine, model_name: str,
                 internal_keys: list[str] | tuple = ()) -> None:  # fmt: skip
        self.model_name = model_name
        self.internal_keys = tuple(internal_keys)
        self.metrics = ServerMetrics(aeng.stats)
        self.client = EngineClient(aeng, self.metrics)
        self.responder = Responder(self.client)
        self.strings = TokenStrings(aeng.engine.tokenizer)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(
                f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                param="model",
            )

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvpool",
            "root": self.model_name,
            "max_model_len": self.client.engine.max_model_len,
        }

    async def health(self) -> JSONResponse:
        if self.client.alive():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine dead"}, status_code=503)

    async def metrics_response(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    def _options(self, include_usage: bool, params: SamplingParams, echo: bool = False,
                 prompt_only: bool = False, sent: int = 0) -> ResponseOptions:  # fmt: skip
        return ResponseOptions(include_usage, echo, prompt_only, sent, params.logprobs or 0)

    async def completions(self, request: Request) -> Response:
        req = parse_request(await request.body(), CompletionRequest)
        self.check_model(req.model)
        params = req.to_sampling_params()
        prompts = req.prompts()
        # tokenizing may take a while on a long prompt: never on the event loop
        ids = await asyncio.to_thread(lambda: [self.client.prepare(p, params) for p in prompts])
        opts = self._options(req.include_usage, params, bool(req.echo), req.prompt_only)
        fmt = CompletionFormat(self.model_name, opts, strings=self.strings)
        texts = [p if isinstance(p, str) else None for p in prompts]
        return await self._respond(request, Job(ids, params, fmt, texts), req.stream)

    async def chat(self, request: Request) -> Response:
        req = parse_request(await request.body(), ChatCompletionRequest)
        self.check_model(req.model)
        params = req.to_sampling_params()
        messages = req.chat_messages()
        if self.client.engine.tokenizer.chat_template is None:
            raise BadRequestError("this model has no chat template; use /v1/completions")
        ids = await asyncio.to_thread(self._chat_ids, messages, params)
        fmt = ChatFormat(self.model_name, self._options(req.include_usage, params),
                         strings=self.strings)  # fmt: skip
        return await self._respond(request, Job([ids], params, fmt), req.stream)

    def _chat_ids(self, messages: list[dict[str, str]], params: SamplingParams) -> list[int]:
        eng = self.client.engine
        eng.check_prompt_chars(sum(len(m["content"]) for m in messages))
        text = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.client.prepare(eng.tokenizer.encode(text, add_special_tokens=False), params)

    async def internal_generate(self, request: Request) -> Response:
        """A request the conductor tokenized (``protocol.decode.DecodeRequest``): no second
        tokenization; its KV handle lets the connector read the prefill worker's blocks. With
        ``internal_keys`` only the cluster's internal bearer may call it (a handle names
        memory to read: not for API clients)."""
        if self.internal_keys:
            given = request.headers.get("authorization", "")
            if not any(hmac.compare_digest(given.encode(), f"Bearer {k}".encode())
                       for k in self.internal_keys):  # fmt: skip
                raise ForbiddenError("/internal/generate takes the cluster's internal bearer")
        try:
            req = DecodeRequest.from_wire(json.loads(await request.body()))
            params = SamplingParams(**req.params)
        except (ValueError, TypeError, ProtocolError) as exc:
            raise BadRequestError(f"bad decode request: {exc}") from None
        prompts, sent = [req.token_ids, *req.more_token_ids], 0
        if req.first_token is not None:  # the conductor streamed it: go on from there
            if params.max_tokens is None or params.max_tokens < 2:
                raise BadRequestError("bad decode request: first_token needs max_tokens >= 2")
            if params.n != 1 or len(prompts) > 1 or params.logprobs is not None or req.echo:
                raise BadRequestError("bad decode request: first_token is for one plain answer")
            prompts[0], sent = [*req.token_ids, req.first_token], 1
            params = dataclasses.replace(params, max_tokens=params.max_tokens - 1,
                                         min_tokens=max(0, params.min_tokens - 1))  # fmt: skip
        for ids in prompts:
            self.client.engine.tokenize(ids)  # token ids in the vocabulary (400s)
            self.client.engine.check_length(len(ids), params)
        cls = ChatFormat if req.kind == "chat" else CompletionFormat
        opts = self._options(req.include_usage, params, req.echo, req.prompt_only, sent)
        fmt = cls(self.model_name, opts, req.response_id, req.created, self.strings)
        job = Job(prompts, params, fmt, kv_handle=req.kv_handle, cached_tokens=req.cached_tokens)
        return await self._respond(request, job, req.stream)

    async def _respond(self, request: Request, job: Job, stream: bool) -> Response:
        if stream:
            body = self.responder.stream(job)
            return _SSEResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)
        outs = await self._until_disconnect(request, self.responder.finals(job))
        if outs is None:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(job.fmt.full(outs))

    async def _until_disconnect(self, request: Request, work):
        """Run ``work``; cancel it (aborting its requests) if the client disconnects first."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            logger.info("client disconnected; request aborted")
            return None
        return task.result()


def build_app(aeng: AsyncLLMEngine, model_name: str, api_keys: list[str] | tuple = (),
              limits: HttpLimits | None = None,
              internal_keys: list[str] | tuple = ()) -> FastAPI:  # fmt: skip
    """The OpenAI-compatible app over a started AsyncLLMEngine (``build_openai_app``), plus
    ``/internal/generate`` (the conductor's typed decode requests; ``internal_keys``)."""
    server = OpenAIServer(aeng, model_name, internal_keys)

    def internal(app: FastAPI) -> None:
        @app.post("/internal/generate")
        async def internal_generate(request: Request) -> Response:
            return await server.internal_generate(request)

    app = build_openai_app(server, "kvpool", "OpenAI-compatible server (single engine)",
                           api_keys, limits, internal)  # fmt: skip
    app.state.server = server
    return app

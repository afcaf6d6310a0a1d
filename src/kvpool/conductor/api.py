"""The conductor's OpenAI-compatible front door.

A request is validated and tokenized here, once, off the event loop (same tokenizer and chat
template as the workers, so block hashes agree); a prompt that can never fit the workers'
context gets 400 before routing. Its prefix is looked up in the pool, the router picks workers
(or rejects it with 429), the prefill worker computes and publishes the prompt's KV (control
RPC) and says where it holds it (a ``KVHandle``), and the decode worker gets a typed
``DecodeRequest`` (token ids, sampling parameters, the handle, the prefill's cached tokens for
usage) on ``/internal/generate``; its response -- a stream or one JSON body, already in the
OpenAI shape -- is relayed to the client (``relay.py``). If the prefill worker fails, the decode worker computes the prompt itself; a
request the prefill worker refuses as bad (400) is the client's fault and goes back to it, and
never marks the worker failed. If the decode worker dies mid-stream, the stream ends with an
error event. Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/health``, ``/metrics``, ``/cluster``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpool.common import auth
from kvpool.common.errors import (
    BackpressureError,
    BadRequestError,
    KVPoolError,
    NotFoundError,
    PayloadTooLargeError,
    ProtocolError,
    RejectedError,
    UnavailableError,
)
from kvpool.common.hashing import block_hashes, namespace_seed
from kvpool.common.rpc_pool import RpcPool
from kvpool.conductor.cluster import ClusterState
from kvpool.conductor.cluster_state import RequestInfo
from kvpool.conductor.metrics import ConductorMetrics
from kvpool.conductor.relay import Flight, Relay, RelayResponse, WorkerFailedError, queue_on
from kvpool.conductor.router import Route, Router
from kvpool.conductor.vllm_relay import VllmCalls
from kvpool.config import HttpLimits
from kvpool.engine.limits import check_context_length, check_prompt_chars, check_token_ids
from kvpool.engine.sampling import SamplingParams
from kvpool.protocol.decode import DecodeRequest, KVHandle
from kvpool.protocol.kv_object import block_key
from kvpool.serving.formats import ChatFormat, CompletionFormat, Delta, ResponseOptions, sse
from kvpool.serving.http_errors import ModelNotFoundError
from kvpool.serving.openai_app import build_openai_app
from kvpool.serving.protocol import ChatCompletionRequest, CompletionRequest, parse_request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Parsed:
    """A client's request as the conductor read it (tokenized once, here)."""

    ids: list[int]  # its (first) prompt
    kind: str  # "chat" | "completion"
    params: dict  # SamplingParams fields
    stream: bool
    include_usage: bool
    max_tokens: int
    more_ids: list[list[int]] = field(default_factory=list)  # a completion's other prompts
    echo: bool = False
    prompt_only: bool = False

    @property
    def computes_on_decode(self) -> bool:
        """Whether the decode worker must compute the prompts itself: several prompts, or
        prompt logprobs (the logits of every prompt position: no KV from elsewhere)."""
        return bool(self.more_ids) or self.params.get("prompt_logprobs") is not None


__all__ = ["Conductor", "WorkerFailedError", "build_conductor_app"]

# errors of a prefill call that say the request was bad, not the worker
_CLIENT_FAULTS = (BadRequestError, NotFoundError, PayloadTooLargeError)


class Conductor(VllmCalls):
    """Request handling behind the routes."""

    def __init__(self, cluster: ClusterState, router: Router, tokenizer, model_name: str,
                 token: str | None = None, prefill_timeout: float = 300.0,
                 prefill_wait: float = 5.0) -> None:  # fmt: skip
        self.cluster, self.router, self.tok = cluster, router, tokenizer
        self._concatenative = bool(getattr(tokenizer, "concatenative", False))
        self.model_name, self.token = model_name, token
        self.prefill_timeout = prefill_timeout
        self.prefill_wait = prefill_wait  # a vLLM prefill's KV: seconds to wait for the pool
        self.metrics = ConductorMetrics(cluster)
        self.inflight = 0  # admitted, not yet answered
        self.arriving = 0  # received, not yet admitted nor refused (being read, tokenized)
        self.metrics.inflight.set_function(lambda: self.inflight)
        self.metrics.arriving.set_function(lambda: self.arriving)
        self.created = int(time.time())
        # workers' HTTP APIs take the internal bearer derived from the cluster token
        headers = {"Authorization": f"Bearer {auth.internal_bearer(token)}"} if token else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0, connect=3.0))
        self.relay = Relay(self.http, self.metrics, cluster.mark_failed)
        # prefill calls block a thread for seconds each: they get their own threads, so the
        # default executor stays free for admission (tokenizing, pool lookups) and a burst is
        # rejected in milliseconds instead of queueing behind the prefills it would wait for
        self._prefills = ThreadPoolExecutor(router.slo.max_inflight,
                                            thread_name_prefix="kvpool-prefill-call")  # fmt: skip
        self._prefill_rpcs: dict[str, RpcPool] = {}  # worker RPC address -> reused connections

    async def close(self) -> None:
        await self.http.aclose()
        self._prefills.shutdown(wait=False, cancel_futures=True)
        for pool in list(self._prefill_rpcs.values()):
            pool.close()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"The model `{model}` does not exist (this server serves "
                                     f"`{self.model_name}`).", param="model")  # fmt: skip

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "kvpool", "root": self.model_name}  # fmt: skip

    # -- one request -----------------------------------------------------------------------

    def tokenize(self, path: str, body: bytes) -> Parsed:
        """A completions or chat request body, tokenized (the only time: the decode worker
        gets the ids); 400 for anything the workers could never serve (run off the event
        loop: it may be long)."""
        limit = self.cluster.max_model_len
        echo = prompt_only = False
        if path.endswith("/chat/completions"):
            req = parse_request(body, ChatCompletionRequest)
            self.check_model(req.model)
            params = req.to_sampling_params()
            if self.tok.chat_template is None:
                raise BadRequestError("this model has no chat template; use /v1/completions")
            messages = req.chat_messages()
            if limit:
                check_prompt_chars(sum(len(m["content"]) for m in messages), limit,
                                   self.tok.max_token_chars)  # fmt: skip
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True)
            prompts = [self.tok.encode(text, add_special_tokens=False)]
        else:
            req = parse_request(body, CompletionRequest)
            self.check_model(req.model)
            params = req.to_sampling_params()
            prompts = [self._prompt_ids(p) for p in req.prompts()]
            echo, prompt_only = bool(req.echo), req.prompt_only
        for ids in prompts:
            if limit:
                check_context_length(len(ids), params.max_tokens, limit)
            if not ids:
                raise BadRequestError("the prompt is empty", param="prompt")
        kind = "chat" if path.endswith("/chat/completions") else "completion"
        wire = {f.name: getattr(params, f.name) for f in fields(SamplingParams) if f.init}
        return Parsed(prompts[0], kind, wire, bool(req.stream), bool(req.include_usage),
                      int(params.max_tokens or 16), prompts[1:], echo, prompt_only)  # fmt: skip

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        limit, vocab = self.cluster.max_model_len, self.cluster.vocab_size or self.tok.vocab_size
        if isinstance(prompt, str):
            if limit:
                check_prompt_chars(len(prompt), limit, self.tok.max_token_chars)
            return self.tok.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        check_token_ids(ids, vocab, limit or len(ids) + 1)
        return ids

    def request_info(self, ids: list[int], max_tokens: int) -> RequestInfo:
        c = self.cluster
        hashes: list[bytes] = []
        if c.namespace is not None:
            usable = ids[: (len(ids) - 1) // c.block_size * c.block_size]
            hashes = block_hashes(usable, c.block_size, namespace_seed(c.namespace))
        pool = c.pool_prefix_blocks([block_key(h) for h in hashes])
        return RequestInfo(len(ids), tuple(hashes), c.block_size, max_tokens, pool)

    async def health(self) -> JSONResponse:
        snap = self.cluster.snapshot()
        alive = [w.id for w in snap.workers if w.alive]
        ok = bool(alive)
        return JSONResponse({"status": "ok" if ok else "no live worker", "workers": alive,
                             "pool_up": snap.pool_up}, status_code=200 if ok else 503)  # fmt: skip

    async def metrics_response(self) -> Response:
        data = await asyncio.to_thread(self.metrics.render)
        return Response(data, media_type=self.metrics.content_type)

    async def completions(self, request: Request) -> Response:
        return await self.handle(request)

    chat = completions

    async def _admit(self, request: Request) -> tuple[bytes, Parsed, RequestInfo, Route]:
        """Read, tokenize and route a request (counted in ``arriving`` meanwhile)."""
        self.arriving += 1
        try:
            raw = await request.body()
            parsed = await asyncio.to_thread(self.tokenize, request.url.path, raw)
            info = await asyncio.to_thread(self.request_info, parsed.ids, parsed.max_tokens)
            if parsed.more_ids or parsed.params.get("n", 1) > 1:  # the work of all its sequences
                info = _all_sequences(info, parsed)
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
            return raw, parsed, info, route
        finally:
            self.arriving -= 1

    async def handle(self, request: Request) -> Response:
        t0 = time.perf_counter()
        raw, parsed, info, route = await self._admit(request)
        ids, stream = parsed.ids, parsed.stream
        flight = self._take_flight(route)  # no await since the routing: one count to the other
        response: Response | None = None
        try:
            cached, handle, first = await self._prefill(route, ids, request.url.path, raw, info) \
                if route.prefill is not None and not parsed.computes_on_decode \
                else (None, None, None)  # fmt: skip
            self.metrics.routed.labels(route.decode.worker_id, "decode").inc()
            if route.on_decode:
                self.metrics.on_decode.labels(route.on_decode).inc()
            dec = self.cluster.worker(route.decode.worker_id)
            if dec is not None and dec.backend is not None:  # a vLLM server: the client's body
                response = await self._to_vllm(request, route, raw, parsed, t0, flight)
                return response
            url = f"http://{self._http_of(route.decode.worker_id)}/internal/generate"
            # the prompt it computes itself is queue time for the next requests routed there
            # until its first token (its own report lags by a poll)
            queued = flight.also(queue_on(dec, route.decode_prompt_tokens if cached is None else 0))
            decode = DecodeRequest(f"decode-{uuid.uuid4().hex}", parsed.kind, ids, parsed.params,
                                   stream, parsed.include_usage, cached, handle,
                                   more_token_ids=parsed.more_ids, echo=parsed.echo,
                                   prompt_only=parsed.prompt_only)  # fmt: skip
            opening = self._first_from_prefill(parsed, first, decode) if stream else []
            body = json.dumps(decode.to_wire()).encode()
            if stream:
                response = RelayResponse(self.relay.stream(url, body, route.decode.worker_id,
                                                           t0, flight, opening,
                                                           on_first=queued), flight)  # fmt: skip
                return response
            return await self.relay.json(request, url, body, route.decode.worker_id, t0,
                                         flight)  # fmt: skip
        finally:
            if not isinstance(response, RelayResponse):  # a stream's flight ends with it
                flight.release()

    def _first_from_prefill(self, parsed: Parsed, first: list | None,
                            decode: DecodeRequest) -> list[str]:  # fmt: skip
        """The stream's opening chunks with the answer's first token, which the prefill worker
        computed (greedily) with the prompt: sent now, one decode step before the decode
        worker could, which goes on from it (``decode`` is told). Only where that token is
        the answer's whatever follows: greedy, no stop conditions, a token that is whole
        text; else ``[]`` and the decode worker streams everything."""
        p = parsed.params
        if not first or not isinstance(first[0], int) or int(p.get("max_tokens") or 0) < 2:
            return []
        if p.get("n", 1) != 1 or p.get("logprobs") is not None or parsed.echo or parsed.more_ids:
            return []  # not one plain answer
        if not self._concatenative:  # the decode worker's text would lose a leading space
            return []
        if p.get("temperature", 1.0) != 0 or p.get("stop") or p.get("stop_token_ids"):
            return []
        t1 = first[0]
        if t1 in self.tok.eos_token_ids and not p.get("ignore_eos"):
            return []
        text = self.tok.decode([t1], skip_special_tokens=p.get("skip_special_tokens", True))
        if not text or "\ufffd" in text:  # a token that is part of a character: not alone
            return []
        fmt = (ChatFormat if parsed.kind == "chat" else CompletionFormat)(
            self.model_name, ResponseOptions(parsed.include_usage))  # fmt: skip
        decode.first_token, decode.response_id, decode.created = t1, fmt.id, fmt.created
        self.metrics.first_from_prefill.inc()
        return [sse(c) for c in [*fmt.first_chunks(), *fmt.delta_chunks(Delta(0, text))]]

    def _take_flight(self, route: Route) -> Flight:
        self.inflight += 1
        decode = self.cluster.worker(route.decode.worker_id)
        if decode is not None:
            decode.inflight += 1

        def release(outcome: str) -> None:
            self.inflight -= 1
            w = self.cluster.worker(route.decode.worker_id)
            if w is not None:
                w.inflight = max(0, w.inflight - 1)
            self.metrics.requests.labels(outcome).inc()

        return Flight(release)

    def _http_of(self, worker_id: str) -> str:
        w = self.cluster.worker(worker_id)
        if w is None or w.view is None:
            raise UnavailableError(f"worker {worker_id} is gone")
        return w.view.address

    async def _prefill(self, route: Route, ids: list[int], path: str, raw: bytes,
                       info: RequestInfo) -> tuple:  # fmt: skip
        """Run the prompt on the prefill worker; (the prompt tokens it reused, where its KV
        is for the decode worker to read, the greedy first token), or Nones if it failed."""
        assert route.prefill is not None
        w = self.cluster.worker(route.prefill.worker_id)
        if w is None or w.view is None:
            return None, None, None
        self.metrics.routed.labels(w.view.id, "prefill").inc()
        rid = f"prefill-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        # until it is done, this prefill is queue time for the next requests routed here (the
        # worker's own report lags by a poll: a burst would all see an empty queue)
        tokens = max(1, len(ids) - (route.prefill.local_blocks + route.prefill.pool_blocks) *
                     self.cluster.block_size)  # fmt: skip
        w.pending_tokens += tokens
        try:
            if w.backend is not None:
                return await self._vllm_prefill(w, path, raw, info, t0)
            return await self._run_prefill(w, rid, ids, t0)
        finally:
            w.pending_tokens -= tokens

    def _prefill_pool(self, address: str) -> RpcPool:
        pool = self._prefill_rpcs.get(address)
        if pool is None:
            pool = RpcPool(address, token=self.token or "", timeout=self.prefill_timeout)
            pool = self._prefill_rpcs.setdefault(address, pool)
        return pool

    async def _run_prefill(self, w, rid: str, ids: list[int], t0: float) -> tuple:
        pool = self._prefill_pool(w.view.rpc)

        def call() -> dict:
            return pool.call("prefill", rid, ids, self.prefill_timeout)

        try:
            result = await asyncio.get_running_loop().run_in_executor(self._prefills, call)
            self.metrics.prefill.observe(time.perf_counter() - t0)
            first = result.get("first_token")
            return (int(result.get("cached_tokens") or 0), _handle(result.get("kv_handle")),
                    first if isinstance(first, list) else None)  # fmt: skip
        except _CLIENT_FAULTS:
            raise  # the request is bad, not the worker: the client hears why
        except KVPoolError as exc:  # the decode worker will compute the prompt itself
            logger.warning("prefill on %s failed (%s); decode computes it", w.view.id, exc)
            if not isinstance(exc, RejectedError | BackpressureError):  # busy is not broken
                self.cluster.mark_failed(w.view.id)
            return None, None, None


def _all_sequences(info: RequestInfo, parsed: Parsed) -> RequestInfo:
    """``info`` of a request's first prompt, widened to all its prompts and sequences (the
    work admission predicts)."""
    more = sum(len(ids) for ids in parsed.more_ids)
    answers = (1 + len(parsed.more_ids)) * int(parsed.params.get("n", 1))
    return replace(
        info, num_prompt_tokens=info.num_prompt_tokens + more, max_tokens=info.max_tokens * answers
    )


def _handle(wire: object) -> KVHandle | None:
    """The prefill's KV handle; a malformed one only means the decode side reads the pool."""
    if not wire:
        return None
    try:
        return KVHandle.from_wire(wire)
    except ProtocolError as exc:
        logger.warning("ignoring a malformed KV handle from a prefill worker: %s", exc)
        return None


def build_conductor_app(conductor: Conductor, api_keys: list[str] | tuple = (),
                        limits: HttpLimits | None = None) -> FastAPI:  # fmt: skip
    """The OpenAI app over the conductor (``build_openai_app``), plus ``/cluster``."""

    def extra(app: FastAPI) -> None:
        @app.get("/cluster")
        async def cluster() -> JSONResponse:
            return JSONResponse(await asyncio.to_thread(conductor.cluster.describe))

    app = build_openai_app(conductor, "kvpool conductor", "OpenAI-compatible, KVCache-aware",
                           api_keys, limits, extra)  # fmt: skip
    app.state.conductor = conductor
    return app

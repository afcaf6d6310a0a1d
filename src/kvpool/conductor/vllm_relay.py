"""Requests to vLLM servers behind the conductor: the body each one gets, and the wait for a
vLLM prefill's KV to reach the pool before the decode side asks for it.

A vLLM server gets the client's own OpenAI body (it tokenizes it again with the same
tokenizer and chat template, and keeps every OpenAI feature it has), with the model name it
serves. A prefill-role server gets the same body cut to one greedy token, not streamed; its
``KVPoolConnector`` writes the prompt's blocks in the background, so before the decode
server (vLLM's connector, or a kvpool worker) looks them up, the conductor waits until the
pool holds them all, or until they stop arriving (a save that was dropped), within a bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvpool.common.errors import BadRequestError
from kvpool.conductor.cluster_state import RequestInfo
from kvpool.conductor.relay import JSON, Flight, RelayResponse, queue_on
from kvpool.protocol.kv_object import block_key

logger = logging.getLogger(__name__)


def vllm_body(body: bytes, model_id: str | None, prefill: bool = False) -> bytes:
    """The client's body for a vLLM server (``prefill``: one token, not streamed)."""
    data = json.loads(body)
    if model_id:
        data["model"] = model_id
    if prefill:
        data.update(max_tokens=1, stream=False, n=1)
        for key in ("stream_options", "min_tokens", "max_completion_tokens", "best_of"):
            data.pop(key, None)
    return json.dumps(data).encode()


def wait_pooled(cluster, hashes: tuple[bytes, ...] | list[bytes], timeout: float = 5.0,
                stall: float = 0.5, interval: float = 0.02) -> int:  # fmt: skip
    """Poll the pool until it holds every block of ``hashes`` (a chain, from its start), no
    new block arrived for ``stall`` seconds, or ``timeout`` passed; the leading blocks it
    holds (a blocking call: run it off the event loop)."""
    keys = [block_key(h) for h in hashes]
    if not keys:
        return 0
    start = last = time.monotonic()
    best = -1
    while True:
        n = cluster.pool_prefix_blocks(keys)
        now = time.monotonic()
        if n >= len(keys):
            return n
        if n > best:
            best, last = n, now
        if now - last >= stall or now - start >= timeout:
            return best
        time.sleep(interval)


class VllmCalls:
    """The conductor's calls to vLLM servers (a mixin of ``Conductor``: it uses its cluster,
    HTTP client, relay, metrics, ``prefill_timeout`` and ``prefill_wait``)."""

    async def _to_vllm(self, request: Request, route, raw: bytes, parsed, t0: float,
                       flight: Flight) -> Response:  # fmt: skip
        """Relay the client's request to a vLLM server; while it has not answered, the prompt
        tokens it computes count as its queue (for routing the next requests)."""
        w = self.cluster.worker(route.decode.worker_id)
        assert w is not None and w.backend is not None
        b = w.backend
        url = f"http://{b.spec.address}{request.url.path}"
        headers = {**JSON, **b.headers}
        body = vllm_body(raw, b.model_id)
        queued = flight.also(queue_on(w, route.decode_prompt_tokens))
        if parsed.stream:
            return RelayResponse(self.relay.stream(url, body, b.id, t0, flight, headers=headers,
                                                   on_first=queued), flight)  # fmt: skip
        return await self.relay.json(request, url, body, b.id, t0, flight, headers=headers)

    async def _vllm_prefill(self, w, path: str, raw: bytes, info: RequestInfo,
                            t0: float) -> tuple:  # fmt: skip
        """The prompt on a prefill-role vLLM server (one token), then the wait for its KV to
        reach the pool; (None, None, None): the decode side finds the blocks in the pool."""
        b = w.backend
        try:
            resp = await self.http.post(f"http://{b.spec.address}{path}",
                                        content=vllm_body(raw, b.model_id, prefill=True),
                                        headers={**JSON, **b.headers},
                                        timeout=self.prefill_timeout)  # fmt: skip
        except httpx.HTTPError as exc:
            logger.warning("prefill on %s failed (%s); decode computes it", b.id, exc)
            self.cluster.mark_failed(b.id)
            return None, None, None
        if resp.status_code == 400:  # the request is bad, not the server
            raise BadRequestError(_vllm_message(resp))
        if resp.status_code != 200:
            logger.warning("prefill on %s answered HTTP %d; decode computes it", b.id,
                           resp.status_code)  # fmt: skip
            if resp.status_code >= 500:
                self.cluster.mark_failed(b.id)
            return None, None, None
        pooled = await asyncio.to_thread(wait_pooled, self.cluster, info.block_hashes,
                                         self.prefill_wait)  # fmt: skip
        self.metrics.prefill.observe(time.perf_counter() - t0)
        if pooled < len(info.block_hashes):
            logger.info("prefill on %s: the pool holds %d of %d blocks", b.id, pooled,
                        len(info.block_hashes))  # fmt: skip
        return None, None, None


def _vllm_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"the vLLM server refused the request (HTTP {resp.status_code})"

"""Closing a stream (a client gone between two chunks) closes its engine requests' iterators
at once, which is what aborts them (the real HTTP server's case: test_client_disconnect.py)."""

from __future__ import annotations

import asyncio

from kvpool.engine.request import CompletionOutput, RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.serving.formats import CompletionFormat
from kvpool.serving.responses import Job, Responder


class _Endless:
    """An engine client seam: every request yields a growing answer until closed."""

    def __init__(self) -> None:
        self.open: set[str] = set()

    async def generate(self, ids, params, request_id, kv_handle=None):
        self.open.add(request_id)
        try:
            text = ""
            while True:
                await asyncio.sleep(0)
                text += "x"
                outs = [CompletionOutput(i, text, [1] * len(text)) for i in range(params.n)]
                yield RequestOutput(request_id, None, ids, outs, False)
        finally:
            self.open.discard(request_id)


def test_closing_a_stream_closes_every_request_before_it_returns():
    async def run() -> tuple[set[str], set[str]]:
        client = _Endless()
        job = Job([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=50, n=2),
                  CompletionFormat("m"))  # fmt: skip
        stream = Responder(client).stream(job)  # type: ignore[arg-type]
        chunks = [await anext(stream) for _ in range(8)]
        assert any('"x' in c for c in chunks), chunks  # answers' text, streamed
        running = set(client.open)
        await stream.aclose()  # no tick of the loop after it: nothing left to the collector
        return running, set(client.open)

    running, left = asyncio.run(run())
    assert len(running) == 2, running  # one engine request per prompt, both streaming
    assert left == set(), f"still generating after the stream closed: {left}"

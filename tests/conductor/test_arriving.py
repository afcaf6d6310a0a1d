"""The conductor counts a request from its arrival: while its body is read and tokenized it is
``arriving`` (a gauge of its own), then admitted (``inflight``) or refused; never neither, so a
burst being tokenized is never "nothing in flight" (the end-to-end case:
tests/security/test_http_hostile.py, early disconnects)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from kvpool.common.errors import RejectedError
from kvpool.conductor.api import Conductor, Parsed
from kvpool.conductor.metrics import ConductorMetrics


class _Request:
    url = SimpleNamespace(path="/v1/completions")

    async def body(self) -> bytes:
        return b"{}"


def _conductor(route) -> tuple[Conductor, threading.Event]:
    """A conductor seam: tokenizing waits for the event; ``route`` answers or raises."""
    gate = threading.Event()
    c = Conductor.__new__(Conductor)
    c.arriving, c.inflight = 0, 0
    c.cluster = SimpleNamespace(snapshot=lambda: None, describe=lambda: {"workers": []})
    c.metrics = ConductorMetrics(c.cluster)
    c.metrics.arriving.set_function(lambda: c.arriving)

    def tokenize(path: str, raw: bytes) -> Parsed:
        assert gate.wait(10)
        return Parsed([1, 2, 3], "completion", {}, False, False, 4)

    c.tokenize = tokenize  # type: ignore[method-assign]
    c.request_info = lambda ids, max_tokens: SimpleNamespace()  # type: ignore[method-assign]
    c.router = SimpleNamespace(route=route)
    return c, gate


def _gauge(c: Conductor) -> float:
    return c.metrics.arriving.collect()[0].samples[0].value


@pytest.mark.parametrize("refused", [False, True])
def test_a_request_is_arriving_until_routed_or_refused(refused):
    def route(snap, info, inflight):
        if refused:
            raise RejectedError("full", reason="queue_full")
        return "a route"

    async def run() -> list:
        c, gate = _conductor(route)
        task = asyncio.ensure_future(c._admit(_Request()))
        for _ in range(100):  # until it is tokenizing (on a thread)
            await asyncio.sleep(0.01)
            if c.arriving:
                break
        seen = [c.arriving, _gauge(c)]
        gate.set()
        try:
            raw, parsed, _, route_ = await task
            seen += [raw, parsed.ids, route_]
        except RejectedError as exc:
            seen.append(exc.reason)
        return [*seen, c.arriving, _gauge(c)]

    seen = asyncio.run(run())
    assert seen[:2] == [1, 1.0]  # counted while it is tokenized
    assert seen[2:-2] == (["queue_full"] if refused else [b"{}", [1, 2, 3], "a route"])
    assert seen[-2:] == [0, 0.0]  # and no longer once it is routed (or refused)

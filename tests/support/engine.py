"""Driving an ``LLMEngine`` in tests."""

from __future__ import annotations


def run_requests(eng, items) -> dict:
    """Adds ``(request_id, prompt, params)`` items, steps until none is left; the finished
    outputs by request id."""
    for rid, prompt, params in items:
        eng.add_request(rid, prompt, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done

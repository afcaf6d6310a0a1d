"""Assertions shared by the serving tests."""

from __future__ import annotations

import json


def sse_events(lines) -> list:
    """Parse SSE ``data:`` lines into JSON objects, ``"[DONE]"`` kept as the string."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(resp, status: int, param: str | None = "__any__") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "__any__":
        assert err["param"] == param, err
    return err

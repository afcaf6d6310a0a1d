"""Fixtures: the API app over the tiny random model, in-process (TestClient) or on a real port."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.serving.api_server import build_app

MODEL = "tiny"


@pytest.fixture
def make_app(tiny_engine_factory):
    """``make_app(api_key=None, **engine_overrides) -> (aeng, app)``; engines stop at teardown."""
    started: list[AsyncLLMEngine] = []
    threads = torch.get_num_threads()

    def make(api_key: str | None = None, **overrides):
        # One torch thread: the tiny model gains nothing from more, and the box has 2 cores.
        eng = tiny_engine_factory(**{"num_threads": 1, **overrides})
        aeng = AsyncLLMEngine(eng).start()
        started.append(aeng)
        return aeng, build_app(aeng, MODEL, api_keys=[api_key] if api_key else [])

    yield make
    for aeng in started:
        aeng.shutdown()
    torch.set_num_threads(threads)  # the engines set it process-wide


@pytest.fixture
def served(make_app):
    """(aeng, TestClient) over a fresh tiny engine."""
    aeng, app = make_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        yield aeng, client


@pytest.fixture
def client(served):
    return served[1]


@pytest.fixture
def live_server(make_app):
    """``start(**engine_overrides) -> (aeng, base_url)``: uvicorn on a free 127.0.0.1 port."""
    import uvicorn

    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(**overrides):
        aeng, app = make_app(**overrides)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return aeng, f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)

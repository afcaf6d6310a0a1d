"""Real kvpool processes for tests: `kvpool serve` (single engine or cluster), and any `kvpool`
subcommand that prints one JSON line when ready (store, worker, transfer peer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.ports import free_port
from support.process import Process

STARTUP_TIMEOUT = 240.0  # the first start converts the GGUF into ~/.cache/kvpool


def kvpool_cmd() -> list[str]:
    script = Path(sys.executable).with_name("kvpool")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvpool.cli"]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, headers: dict | None = None) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"kvpool serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"kvpool serve not healthy after {STARTUP_TIMEOUT:.0f}s:\n{log.read_text()}")


def serve(log: Path, *flags: str, env: dict | None = None, headers: dict | None = None):
    """Generator for a module fixture: yields (process, base url); stops it with SIGTERM and
    checks it stopped cleanly. ``env``: extra environment (e.g. the cluster token), else none
    of the caller's tokens reach it; ``headers``: what the health check sends."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
           "HF_HUB_OFFLINE": "1", **(env or {})}  # fmt: skip
    cmd = [*kvpool_cmd(), "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    server = Process(cmd, log=log, env=env, name="kvpool serve")  # stdout and stderr: the log
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server.proc, url, log, headers)
        yield server.proc, url
    finally:
        server.stop(signal.SIGTERM, timeout=60)
        if server.killed:
            pytest.fail(f"kvpool serve ignored SIGTERM:\n{log.read_text()}")
    assert server.proc.returncode == 0, log.read_text()
    assert "ready on" in log.read_text() and "stopped" in log.read_text()


class Proc(Process):
    """A ``kvpool`` subcommand that prints one JSON line when ready (store, worker); ``env``:
    extra environment. Its stderr is inherited (pytest shows it with a failure)."""

    def __init__(self, *argv: str, env: dict | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        super().__init__([*kvpool_cmd(), *argv], pipe_stdout=True, env=env,
                         ready=STARTUP_TIMEOUT, name=f"kvpool {' '.join(argv[:4])}")  # fmt: skip

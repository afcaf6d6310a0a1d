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
from services import free_port

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
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, headers)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                pytest.fail(f"kvpool serve ignored SIGTERM:\n{log.read_text()}")
    assert proc.returncode == 0, log.read_text()
    assert "ready on" in log.read_text() and "stopped" in log.read_text()


class Proc:
    """A ``kvpool`` subcommand that prints one JSON line when ready (store, worker); ``env``:
    extra environment."""

    def __init__(self, *argv: str, env: dict | None = None) -> None:
        import json

        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc = subprocess.Popen([*kvpool_cmd(), *argv], stdout=subprocess.PIPE, text=True,
                                     env=env)  # fmt: skip
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{argv} exited with {self.proc.wait(10)}")
        self.info = json.loads(line)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()
        return self.proc.returncode

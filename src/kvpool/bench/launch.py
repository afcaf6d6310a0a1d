"""Starting and stopping ``kvpool serve`` configurations for comparisons."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PRESETS: dict[str, list[str]] = {
    "disaggregated": ["--prefill", "1", "--decode", "1"],
    "colocated": ["--colocated", "2"],
    "no-prefix-cache": ["--colocated", "2", "--no-prefix-caching"],
}
# measuring, not admission: no SLO rejections, a generous in-flight bound
MEASURE_FLAGS = ["--slo-ttft", "0", "--slo-tbt", "0", "--max-inflight", "4096"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A process (its own session) with its log; ``stop()`` sends it SIGTERM, then kills its
    session after ``grace``."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log, self.cmd = log, cmd
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def wait_http(self, url: str, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{what} not ready after {timeout:.0f}s:\n{self.tail()}")

    def wait_ready(self, timeout: float, what: str) -> None:
        """Until the process printed its ``{"ready": true, ...}`` line (kvpool store)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if '"ready": true' in self.log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"{what} not ready after {timeout:.0f}s:\n{self.tail()}")

    def ready_info(self) -> dict:
        """The ``{"ready": true, ...}`` line it printed."""
        for line in self.log.read_text(errors="replace").splitlines():
            if '"ready": true' in line:
                return json.loads(line[line.index("{") :])
        raise RuntimeError(f"no ready line in {self.log}")

    def stop(self, grace: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        try:  # the leader stops its own children; what is left after ``grace`` is killed
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Served:
    """``kvpool serve FLAGS`` on a free port, healthy, until ``stop()``."""

    def __init__(self, flags: list[str], logfile: Path, timeout: float = 300.0,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logfile = logfile
        cmd = [sys.executable, "-m", "kvpool.cli", "serve", "--port", str(self.port),
               "--log-level", "warning", *flags]  # fmt: skip
        self.proc = Proc(cmd, logfile, {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        self.proc.wait_http(f"{self.url}/health", timeout, f"kvpool serve {' '.join(flags)}")

    def stop(self) -> None:
        self.proc.stop(grace=60)

"""Starting and stopping ``kvpool serve`` configurations for comparisons."""

from __future__ import annotations

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


class Served:
    """``kvpool serve FLAGS`` on a free port, healthy, until ``stop()``."""

    def __init__(self, flags: list[str], logfile: Path, timeout: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        self.logfile = logfile
        cmd = [sys.executable, "-m", "kvpool.cli", "serve", "--port", str(self.port),
               "--log-level", "warning", *flags]  # fmt: skip
        with logfile.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpool serve {' '.join(flags)} exited: "
                                   f"{logfile.read_text()[-2000:]}")  # fmt: skip
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"kvpool serve {' '.join(flags)} not healthy after {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

"""Real kvpool processes for store tests (``python -m kvpool.cli ...``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys


class Proc:
    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli", *argv],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{argv} exited with {self.proc.wait(10)}")
        self.info = json.loads(line)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()
        return self.proc.returncode

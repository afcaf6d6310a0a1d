"""A real peer process (``kvpool transfer peer``) driven from tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys


class PeerProcess:
    """Registers ``segment`` of ``size`` bytes in another process; ``cmd`` talks to it."""

    def __init__(self, segment: str, size: int, directory: str, *extra: str) -> None:
        self.segment = segment
        self.size = size
        argv = [
            sys.executable, "-m", "kvpool.cli", "transfer", "peer",
            "--segment", segment, "--size", str(size), "--directory", directory, *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {segment} exited with {self.proc.wait(10)}")
        self.info = json.loads(line)
        self.port = self.info["port"]

    def cmd(self, line: str) -> str:
        """One command, one reply line (pytest-timeout bounds a peer that never answers)."""
        assert self.proc.poll() is None, "peer is not running"
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def fill(self, seed: int) -> None:
        assert self.cmd(f"fill {seed}") == "ok"

    def digest(self, offset: int, length: int) -> str:
        return self.cmd(f"digest {offset} {length}")

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()

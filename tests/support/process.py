"""The one process wrapper of the tests: a child process whose every wait is bounded.

``Process`` starts a command (its stderr, and its stdout unless piped, into a log file when
given), optionally reads the JSON line it prints when ready (``info``), answers commands on its
stdin (``cmd``: one line out, one line back), and stops it: a signal (or closing its stdin),
then SIGKILL after a timeout. The test wrappers (``support.procs``, ``support.etcd``,
``support.transfer``, the netns rig) only choose the command, the environment and the pipes.

Lines are read with ``select`` on the pipe, so a line-at-a-time protocol is assumed (one ready
line, then one reply per command): ``select`` sees the pipe, not what Python already buffered.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path


class Process:
    """``argv`` as a child process. ``log``: where its stderr goes (and its stdout, unless
    ``pipe_stdout``; None: both are inherited, as pytest captures them); ``stdin``: as for
    ``Popen`` (None inherits, ``subprocess.PIPE`` for ``cmd``); ``env``: its whole
    environment (None: ours); ``ready``: read its JSON ready line within that many seconds
    (the process is killed if none comes); ``name``: what errors call it."""

    def __init__(self, argv: list[str], *, log: Path | None = None, pipe_stdout: bool = False,
                 stdin=None, env: dict | None = None, ready: float | None = None,
                 name: str | None = None) -> None:  # fmt: skip
        self.argv, self.log = argv, log
        self.name = name or str(argv[:4])
        self.info: dict = {}
        self.killed = False  # stop() had to SIGKILL it
        self._log = log.open("wb") if log is not None else None
        err = self._log if self._log is not None else None
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE if pipe_stdout else err,
                                     stderr=err, stdin=stdin, env=env, text=True)  # fmt: skip
        if ready is not None:
            try:
                self.info = json.loads(self.readline(ready))
            except BaseException:
                self.stop(signal.SIGKILL, timeout=10)
                raise

    # -- state and output -----------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def readline(self, timeout: float) -> str:
        """The next line of its stdout, waiting at most ``timeout`` seconds."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            if ready:  # end of file: it exited (or closed its stdout)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
                why = f"exited with {self.proc.poll()}"
            else:
                why = f"no output within {timeout:.0f} s (exit {self.proc.poll()})"
            tail = self.tail()
            raise RuntimeError(f"{self.name}: {why}" + (f":\n{tail}" if tail else ""))
        return line

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` of its log ("" without one)."""
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    # -- the stdin command channel --------------------------------------------------------------

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def cmd(self, line: str, timeout: float = 60) -> str:
        """Send one command line; its one reply line (stripped), within ``timeout`` s."""
        assert self.running(), f"{self.name} is not running"
        self.send(line)
        return self.readline(timeout).strip()

    # -- signals ------------------------------------------------------------------------------

    def send_signal(self, sig: int) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP, then wait (bounded) until every thread is stopped: the signal is delivered
        asynchronously, and a test that stalls a peer must not race a peer still answering."""
        self.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stopped():
            time.sleep(0.005)

    def _stopped(self) -> bool:
        tasks = Path(f"/proc/{self.proc.pid}/task")
        try:
            states = [
                (t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()
            ]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return True  # gone (or not Linux): nothing left to wait for
        return all(st in ("T", "t") for st in states)

    def resume(self) -> None:
        self.send_signal(signal.SIGCONT)

    def kill(self) -> int | None:
        """SIGKILL (a fault, not a clean-up: the pipes stay open until ``stop``)."""
        if self.running():
            self.resume()
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return self.proc.returncode

    def stop(self, sig: int | None = signal.SIGTERM, timeout: float = 30) -> int | None:
        """Send ``sig`` (None: close its stdin instead, for a process that stops at end of
        input), wait up to ``timeout`` s, then SIGKILL (``killed``); close its pipes and log.
        Its exit code. A paused process is resumed first, so it can act on the signal."""
        if self.running():
            self.resume()
            if sig is None:
                with contextlib.suppress(OSError, ValueError):
                    self.proc.stdin.close()
            else:
                self.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.killed = True
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
        self.close_files()
        return self.proc.returncode

    def close_files(self) -> None:
        for f in (self.proc.stdout, self.proc.stdin, self._log):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

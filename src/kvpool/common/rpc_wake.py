"""How the RPC server's worker threads wake its selector thread: a non-blocking pipe whose
read end the selector watches; a finished call writes one byte (a full pipe means the loop
is awake already)."""

from __future__ import annotations

import contextlib
import os
import threading


class WakePipe:
    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._open = True

    def signal(self) -> None:
        """From any thread; after ``close`` it does nothing."""
        with self._lock:
            if self._open:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        """On the selector thread: the bytes written so far are read."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.read_fd, 4096)

    def close(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                os.close(self.read_fd)
                os.close(self._write_fd)

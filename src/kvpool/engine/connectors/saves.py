"""Saves in the background: the engine hands over full blocks, a thread writes them while the
engine computes the next chunk, and the engine learns which are done.

``Saver.save`` queues blocks (never blocks the step); the save thread gathers whatever else is
queued (up to ``BATCH`` blocks) into one ``write`` call. ``poll_saved`` returns the block ids
whose save finished, successfully or not (the engine keeps each block referenced until then,
so the bytes being written cannot be reused under the writer). ``wait_saved`` waits for given
blocks (a prefill hand-off waits for its prompt's blocks); that wait is reported to
``on_wait``: save time that compute did not hide.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from kvpool.engine.connectors.base import BlockRef

logger = logging.getLogger(__name__)
BATCH = 64  # blocks gathered into one write


class Saver:
    def __init__(self, write: Callable[[list[BlockRef]], None],
                 on_wait: Callable[[float], None] | None = None) -> None:  # fmt: skip
        self._write = write
        self._on_wait = on_wait
        self._queue: queue.SimpleQueue[list[BlockRef] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: list[int] = []
        self._pending: dict[bytes, int] = {}  # hashes queued or being written
        self._cv = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name="kvpool-kv-save", daemon=True)

    def start(self) -> Saver:
        self._thread.start()
        return self

    def save(self, blocks: list[BlockRef]) -> None:
        with self._lock:
            for r in blocks:
                self._pending[r.block_hash] = self._pending.get(r.block_hash, 0) + 1
        self._queue.put(list(blocks))

    def poll_saved(self) -> list[int]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait_saved(self, block_hashes: list[bytes], timeout: float) -> bool:
        """Block until none of ``block_hashes`` is still being saved (at most ``timeout``)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        with self._cv:
            while any(h in self._pending for h in block_hashes):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            ok = not any(h in self._pending for h in block_hashes)
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - t0)
        return ok

    def _loop(self) -> None:
        while True:
            refs = self._queue.get()
            if refs is None:
                return
            while len(refs) < BATCH:  # gather what else is queued into one batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                refs.extend(more)
            try:
                self._write(refs)
            except Exception:  # a save is best effort: never lose the thread (or the blocks)
                logger.exception("saving %d blocks failed", len(refs))
            self._finished(refs)

    def _finished(self, refs: list[BlockRef]) -> None:
        with self._cv:
            for r in refs:
                self._done.append(r.block_id)
                left = self._pending.get(r.block_hash, 0) - 1
                if left > 0:
                    self._pending[r.block_hash] = left
                else:
                    self._pending.pop(r.block_hash, None)
            self._cv.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """Finish what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

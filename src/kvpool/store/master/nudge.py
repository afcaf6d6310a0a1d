"""Nudges: the master asks a node to heartbeat now because it has index deltas waiting.

A node's index (what its segment holds) is what a newly elected master rebuilds its table
from, so an acknowledged put survives a master fail-over once its nodes hold the delta. Nodes
fetch deltas with their heartbeat (every second); a nudge makes that milliseconds. Nudges go
from one thread, at most one per node every ``min_gap`` seconds (a burst of puts costs one
heartbeat per node per gap), and never block a put.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvpool.common.errors import KVPoolError
from kvpool.common.rpc import RpcClient

logger = logging.getLogger(__name__)


class Nudger:
    """``mark(node_id)`` (cheap, any thread); a thread sends ``poke`` to the marked nodes."""

    def __init__(self, address_of: Callable[[str], str | None], token: str | None,
                 min_gap: float = 0.005) -> None:  # fmt: skip
        self._address_of = address_of
        self._token = token
        self._min_gap = min_gap
        self._marked: set[str] = set()
        self._last: dict[str, float] = {}
        self._clients: dict[str, RpcClient] = {}
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvpool-nudge", daemon=True)
        self._thread.start()

    def mark(self, node_id: str) -> None:
        with self._cv:
            if node_id not in self._marked:
                self._marked.add(node_id)
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._marked and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                marked, self._marked = self._marked, set()
            now = time.monotonic()
            wait = max((self._last.get(n, 0.0) + self._min_gap - now for n in marked), default=0)
            if wait > 0:
                time.sleep(wait)
            for node_id in marked:
                self._poke(node_id)

    def _poke(self, node_id: str) -> None:
        self._last[node_id] = time.monotonic()
        address = self._address_of(node_id)
        if address is None:
            return
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = RpcClient(address, self._token, timeout=1.0)
        try:
            client.call("poke")
        except KVPoolError as exc:  # its next heartbeat fetches the deltas anyway
            logger.debug("master: nudging node %s failed: %s", node_id, exc)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)
        for client in self._clients.values():
            client.close()

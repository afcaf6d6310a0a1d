"""Pushes of index deltas from the master to its nodes.

A node's index (what its segment holds) is what a newly elected master rebuilds its table
from, so an acknowledged put survives a master fail-over once its nodes hold the delta. Nodes
fetch deltas with their heartbeat (every second); the master also pushes them: a put_end marks
the nodes of its replicas, and one thread sends each marked node everything it has not
acknowledged yet (``take``) and records the node's acknowledgement (``acked``). A burst of
puts costs one push per node per ``min_gap`` seconds; with durable commits (``min_gap`` 0) a
put_end waits for its push (``MasterService(commit_wait=...)``), so no acknowledged put is lost
when the master dies right after answering.
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
    """``mark(node_id)`` (cheap, any thread); a thread pushes deltas to the marked nodes.

    ``take(node_id)`` -> ``(epoch, entries, last_seq)`` or None (nothing to send, or the node
    is gone); ``acked(node_id, epoch, seq)`` records what the node applied."""

    def __init__(self, address_of: Callable[[str], str | None], token: str | None,
                 take: Callable[[str], tuple[str, list, int] | None],
                 acked: Callable[[str, str, int], None], min_gap: float = 0.005) -> None:  # fmt: skip
        self._address_of = address_of
        self._token = token
        self._take, self._acked = take, acked
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
                self._push(node_id)

    def _push(self, node_id: str) -> None:
        self._last[node_id] = time.monotonic()
        address = self._address_of(node_id)
        batch = self._take(node_id) if address is not None else None
        if batch is None:
            return
        epoch, entries, seq = batch
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = RpcClient(address, self._token, timeout=1.0)
        try:
            applied = client.call("deltas", epoch, seq, entries)
        except KVPoolError as exc:  # its next heartbeat fetches the deltas anyway
            logger.debug("master: pushing deltas to node %s failed: %s", node_id, exc)
            return
        if applied:
            self._acked(node_id, epoch, seq)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)
        for client in self._clients.values():
            client.close()

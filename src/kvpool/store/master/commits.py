"""Durable commits: a put is acknowledged once the nodes of its replicas hold its index entry.

A master elected after a fail-over rebuilds its table from the nodes' indexes, so a commit
the nodes have not received yet is lost with the leader. With ``wait_s`` > 0 (``kvpool store
master --etcd``: there is a standby), put_end waits, the master lock released, until the
``Nudger`` has pushed the object's deltas and the nodes acknowledged them, for at most
``wait_s``; a node that lets a wait time out is not waited for again until it confirms (the
master serves calls on one thread: a hung node must cost one put ``wait_s``, not every put).
Every method but ``take`` and ``acked`` (the nudger's, which lock themselves) is called with
the master lock held.
"""

from __future__ import annotations

import logging
import threading
import time

from kvpool.store.master.tracked import TrackedState

logger = logging.getLogger(__name__)


class Commits:
    def __init__(self, state: TrackedState, lock: threading.Lock, wait_s: float) -> None:
        self.state, self.lock, self.wait_s = state, lock, wait_s
        self._acked = threading.Condition(lock)  # a node acknowledged deltas
        self.unconfirmed: set[str] = set()  # nodes that let a commit wait time out

    def marks(self, keys: list[str]) -> dict[str, int]:
        """Per node of these keys' replicas, the seq of the last delta queued for it ({}
        unless durable; nodes not confirming are left out)."""
        if self.wait_s <= 0:
            return {}
        st = self.state
        nodes = {r.node_id for k in keys if k in st.objects for r in st.objects[k].replicas}
        return {n: st.delta_base[n] + len(st.deltas[n]) - 1 for n in nodes
                if n in st.deltas and n not in self.unconfirmed}  # fmt: skip

    def wait(self, marks: dict[str, int]) -> None:
        """Until every node acknowledged its mark or left, or ``wait_s`` passed (then the put
        is acknowledged anyway, and counted in ``unconfirmed_commits``)."""
        if not marks:
            return
        st = self.state
        deadline = time.monotonic() + self.wait_s

        def late() -> set[str]:
            return {n for n, seq in marks.items() if n in st.deltas and st.delta_base[n] <= seq}

        while waiting := late():
            left = deadline - time.monotonic()
            if left <= 0:
                st.counters["unconfirmed_commits"] += 1
                if waiting - self.unconfirmed:
                    logger.warning("master: nodes %s did not confirm index entries within "
                                   "%.1f s; not waiting for them until they do",
                                   sorted(waiting), self.wait_s)  # fmt: skip
                self.unconfirmed |= waiting
                return
            self._acked.wait(left)

    def heard(self, node_id: str, caught_up: bool) -> None:
        """A heartbeat acknowledged deltas (``caught_up``: it holds them all)."""
        if caught_up:
            self.unconfirmed.discard(node_id)
        self._acked.notify_all()

    def take(self, node_id: str) -> tuple[str, list, int] | None:
        """What to push to a node: (stream epoch, its unacknowledged deltas, last seq)."""
        with self.lock:
            if node_id not in self.state.deltas or not self.state.deltas[node_id]:
                return None
            entries, seq = self.state.take_deltas(node_id, None, 0)
            return self.state.stream_epoch(node_id), entries, seq

    def acked(self, node_id: str, epoch: str, seq: int) -> None:
        """The node applied a push up to ``seq``."""
        with self.lock:
            if node_id in self.state.deltas:
                self.state.take_deltas(node_id, epoch, seq)
            self.unconfirmed.discard(node_id)
            self._acked.notify_all()

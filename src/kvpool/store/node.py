"""A storage node: contributes a DRAM segment to the pool and keeps an index of its contents.

The segment is a transfer-engine segment in shared memory (same-host clients copy straight
from it; others go through the node's transfer server over TCP). The node mounts it at the
master, heartbeats, and applies the index deltas the master returns (objects committed to or
deleted from its segment). When a master does not know it (a restarted or newly elected
master), the node mounts again and reports its index, so the master rebuilds its table.
"""

from __future__ import annotations

import logging
import threading

from kvpool.common.errors import KVPoolError
from kvpool.config import TransferConfig
from kvpool.store.link import MasterLink
from kvpool.transfer import TransferEngine

logger = logging.getLogger(__name__)


class StorageNode:
    """Owns ``memory`` bytes of pool space; runs until ``close``."""

    def __init__(
        self,
        node_id: str,
        master: str,
        memory: int,
        transfer: TransferEngine | TransferConfig | None = None,
        heartbeat_interval: float = 1.0,
        token: str | None = None,
    ) -> None:
        if memory <= 0:
            raise ValueError("a node needs memory > 0 bytes")
        self.node_id = node_id
        self.segment_name = f"{node_id}/dram"
        self._own_engine = not isinstance(transfer, TransferEngine)
        self.engine = transfer if isinstance(transfer, TransferEngine) else TransferEngine(transfer)
        self.segment = self.engine.register(self.segment_name, size=memory)
        self.master = MasterLink(master, token=token, timeout=5.0)
        self.index: dict[str, tuple[int, int, int | None]] = {}  # key -> (offset, size, checksum)
        self._lock = threading.Lock()
        self._interval = heartbeat_interval
        self._stop = threading.Event()
        self._mount()
        self._thread = threading.Thread(target=self._beat_loop, name="kvpool-node", daemon=True)
        self._thread.start()

    def _mount(self) -> None:
        self.master.call("mount", self.node_id, self.segment_name, "dram", self.segment.size)
        with self._lock:
            items = [[k, s, self.segment_name, o, c] for k, (o, s, c) in self.index.items()]
        if items:
            adopted = self.master.call("report", self.node_id, items)
            logger.info(
                "node %s: master adopted %d of %d objects", self.node_id, adopted, len(items)
            )

    def beat(self) -> None:
        """One heartbeat: apply index deltas, or mount again if the master forgot us."""
        reply = self.master.call("heartbeat", self.node_id)
        if not reply["known"]:
            self._mount()
            return
        with self._lock:
            for op, key, size, _segment, offset, checksum in reply["deltas"]:
                if op == "add":
                    self.index[key] = (offset, size, checksum)
                elif self.index.get(key, (None,))[0] == offset:
                    del self.index[key]

    def _beat_loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.beat()
            except KVPoolError as exc:
                logger.warning("node %s: heartbeat failed: %s", self.node_id, exc)

    def stats(self) -> dict:
        with self._lock:
            return {
                "objects": len(self.index),
                "bytes": sum(size for _, size, _ in self.index.values()),
                "capacity": self.segment.size,
            }

    def retarget(self, master: str) -> None:
        """Follow a new master (fail-over); the next heartbeat mounts and reports."""
        self.master.retarget(master)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.master.close()
        if self._own_engine:
            self.engine.close()
        else:
            self.engine.unregister(self.segment_name)

"""A storage node: contributes a DRAM segment to the pool and keeps an index of its contents.

The segment is a transfer-engine segment in shared memory (same-host clients copy straight
from it; others go through the node's transfer server over TCP). The node mounts it at the
master, heartbeats, and applies the index deltas the master returns (objects committed to or
deleted from its segment). When a master does not know it (a restarted or newly elected
master), the node mounts again and reports its index, so the master rebuilds its table.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import numpy as np

from kvpool.common import auth
from kvpool.common.errors import BadRequestError, KVPoolError
from kvpool.common.rpc import RpcServer
from kvpool.config import TransferConfig
from kvpool.protocol.store import IndexDelta
from kvpool.store.client import transfer_config
from kvpool.store.link import MasterLink
from kvpool.transfer import TransferEngine

logger = logging.getLogger(__name__)
REPORT_CHUNK = 4096  # objects per mount/report call (within the RPC's bulk limits)


class StorageNode:
    """Owns ``memory`` bytes of pool space; runs until ``close``. ``token``: the cluster token
    (None: from the environment)."""

    def __init__(
        self,
        node_id: str,
        master: str,
        memory: int,
        transfer: TransferEngine | TransferConfig | None = None,
        heartbeat_interval: float = 1.0,
        token: str | None = None,
        ssd_path: str | None = None,
        ssd_size: int = 0,
    ) -> None:
        if memory <= 0:
            raise ValueError("a node needs memory > 0 bytes")
        token = auth.cluster_token(token)
        self.node_id = node_id
        self.segment_name = f"{node_id}/dram"
        self._own_engine = not isinstance(transfer, TransferEngine)
        self.engine = transfer if isinstance(transfer, TransferEngine) else \
            TransferEngine(transfer_config(transfer, token, master))  # fmt: skip
        # which life of the node this is: its segments' owner (a restart starts clean, and
        # clients drop descriptors of a previous life)
        self.incarnation = self.engine.owner_id
        self.segment = self.engine.register(self.segment_name, size=memory)
        self.ssd = None
        if ssd_path and ssd_size > 0:  # a file on the SSD, mapped: the OS pages it in and out
            os.makedirs(ssd_path, exist_ok=True)
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in node_id)
            path = os.path.join(ssd_path, f"kvpool-{safe}-{os.getpid()}.ssd")
            self.ssd = self.engine.register(f"{node_id}/ssd", size=ssd_size, path=path)
        # the master asks this node to copy objects between its tiers, and pushes index deltas
        self.rpc = RpcServer({"copy": self.copy, "deltas": self.deltas}, self.engine.config.host,
                             0, token or "").start()  # fmt: skip
        self.master = MasterLink(master, token=token or "", timeout=5.0)
        # key -> (segment, offset, size, checksum)
        self.index: dict[str, tuple[str, int, int, int | None]] = {}
        self._lock = threading.Lock()
        self._interval = heartbeat_interval
        self._ack: tuple[str | None, int] = (None, 0)  # (master epoch, last delta seq applied)
        self._stop = threading.Event()
        self._wake = threading.Event()  # heartbeat now (a new master to follow, or closing)
        self._mount()
        self._thread = threading.Thread(target=self._beat_loop, name="kvpool-node", daemon=True)
        self._thread.start()

    def _mount(self) -> None:
        """Mount each segment together with what it holds (one step on the master, so a new
        leader never allocates over objects it has not adopted yet)."""
        address = self.rpc.address
        with self._lock:
            items = [[k, s, seg, o, c] for k, (seg, o, s, c) in self.index.items()]
        segments = [(self.segment_name, "dram", self.segment.size)]
        if self.ssd is not None:
            segments.append((self.ssd.name, "ssd", self.ssd.size))
        for name, tier, size in segments:
            mine = [i for i in items if i[2] == name]
            chunks = [mine[i : i + REPORT_CHUNK] for i in range(0, len(mine), REPORT_CHUNK)]
            chunks = chunks or [[]]
            # the segment takes no allocation until its last chunk is adopted
            self.master.call("mount", self.node_id, name, tier, size, address, chunks[0],
                             len(chunks) == 1, self.incarnation)  # fmt: skip
            for k, chunk in enumerate(chunks[1:], 2):
                self.master.call("report", self.node_id, chunk,
                                 name if k == len(chunks) else None)  # fmt: skip
        if items:
            logger.info("node %s: mounted, reporting %d objects", self.node_id, len(items))

    def beat(self) -> None:
        """One heartbeat: apply index deltas, or mount again if the master forgot us."""
        reply = self.master.call("heartbeat", self.node_id, self._ack[0], self._ack[1],
                                 self.incarnation)  # fmt: skip
        if not reply["known"]:
            self._mount()
            return
        self._apply(reply.get("epoch"), int(reply.get("seq", 0)), reply["deltas"])

    def _apply(self, epoch: str | None, seq: int, deltas: list) -> None:
        """Apply index deltas up to ``seq`` of ``epoch`` (acknowledged with the next beat).
        ``deltas`` are the seqs ``seq - len(deltas) + 1 .. seq``; a push and a heartbeat reply
        may cross, so those already applied are skipped (a stale "add" after a "del" would
        resurrect an object)."""
        typed = [IndexDelta.from_wire(e) for e in deltas]  # all checked before any applies
        with self._lock:
            if epoch == self._ack[0]:
                typed = typed[max(0, len(typed) - (seq - self._ack[1])):] \
                    if seq > self._ack[1] else []  # fmt: skip
            for d in typed:
                if d.op == "add":
                    self.index[d.key] = (d.segment, d.offset, d.size, d.checksum)
                elif self.index.get(d.key, (None, None))[:2] == (d.segment, d.offset):
                    del self.index[d.key]
            if epoch != self._ack[0] or seq > self._ack[1]:
                self._ack = (epoch, seq)

    def deltas(self, epoch: str, seq: int, entries: list) -> bool:
        """The master pushes the deltas this node has not acknowledged, up to ``seq``
        (applying one twice is harmless); True once applied."""
        if not isinstance(epoch, str) or not isinstance(seq, int) or not isinstance(entries, list):
            raise BadRequestError("deltas: epoch (str), seq (int), entries (list) expected")
        self._apply(epoch, seq, entries)  # each entry checked (IndexDelta.from_wire) first
        return True

    def copy(self, src: str, src_offset: int, dst: str, dst_offset: int, size: int) -> bool:
        """Copy ``size`` bytes between two of this node's segments (a tier move)."""
        a, b = self.engine.segment(src).array, self.engine.segment(dst).array
        if (
            min(src_offset, dst_offset, size) < 0
            or src_offset + size > len(a)
            or (dst_offset + size > len(b))
        ):
            raise BadRequestError("copy range outside the node's segments")
        np.copyto(b[dst_offset : dst_offset + size], a[src_offset : src_offset + size])
        return True

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.beat()
            except KVPoolError as exc:
                logger.warning("node %s: heartbeat failed: %s", self.node_id, exc)

    def stats(self) -> dict:
        with self._lock:
            return {
                "objects": len(self.index),
                "bytes": sum(size for _, _, size, _ in self.index.values()),
                "capacity": self.segment.size,
                "ssd_capacity": self.ssd.size if self.ssd is not None else 0,
            }

    def retarget(self, master: str) -> None:
        """Follow a new master (fail-over); the next heartbeat mounts and reports."""
        self.master.retarget(master)

    def close(self) -> None:
        """Leave the pool: unmount at once (its objects are withdrawn, not left to expire),
        then free the memory."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(KVPoolError):  # a gone master drops us at node_ttl anyway
            self.master.rpc.call("unmount", self.node_id, self.incarnation, timeout=2.0)
        self.master.close()
        self.rpc.close()
        if self._own_engine:
            self.engine.close()
            return
        self.engine.unregister(self.segment_name)
        if self.ssd is not None:
            self.engine.unregister(self.ssd.name)

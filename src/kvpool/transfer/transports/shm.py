"""Shared-memory transport: map a same-host peer's segment once, copy with the GIL released.

Batches up to ``shm_inline_bytes`` are copied by the submitting thread (cheaper than any
thread hand-off); larger ones by one copy thread per engine, so ``submit`` returns at once and a
whole batch costs one hand-off. ``numpy.copyto`` releases the GIL either way. The mapping stays valid if the owner
dies, so liveness is checked after each batch: bytes read from a dead owner's segment are not
reported as done.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

import numpy as np

from kvpool.common.errors import KVPoolTimeoutError, TransferError
from kvpool.transfer.protocol import Op
from kvpool.transfer.request import PendingOp, finish_ops
from kvpool.transfer.segment import SHM_DIR, SegmentDescriptor, SharedRegion, pid_alive
from kvpool.transfer.transports.base import Transport, TransportContext, register_transport

logger = logging.getLogger(__name__)


@register_transport("shm")
class ShmTransport(Transport):
    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._maps: dict[str, SharedRegion] = {}
        self._maps_lock = threading.Lock()
        self._queue: queue.SimpleQueue[list[PendingOp] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="kvpool-shm-copy", daemon=True)
        self._worker.start()

    def can_reach(self, desc: SegmentDescriptor) -> bool:
        if desc.owner_id == self.ctx.owner_id:
            return True
        return (
            desc.shm_name is not None
            and desc.boot_id == self.ctx.boot_id
            and os.path.exists(os.path.join(SHM_DIR, desc.shm_name))
        )

    def is_inline(self, nbytes: int) -> bool:
        return nbytes <= self.ctx.config.shm_inline_bytes

    def submit(self, ops: list[PendingOp]) -> None:
        for op in ops:
            op.transport = self.name
        if self.is_inline(sum(op.length for op in ops)):
            # below this a memcpy costs less than waking the copy thread: copy right here
            self._finish([op for op in ops if self._copy(op)])
        else:
            self._queue.put(ops)

    def cancel(self, op: PendingOp) -> None:
        op.timed_out = True  # the worker fails it unless its copy already ran

    def forget(self, desc: SegmentDescriptor) -> None:
        if desc.shm_name is None:
            return
        with self._maps_lock:
            region = self._maps.pop(desc.shm_name, None)
        if region is not None:
            region.close()

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5)
        with self._maps_lock:
            regions, self._maps = list(self._maps.values()), {}
        for region in regions:
            region.close()

    def _run(self) -> None:
        while True:
            ops = self._queue.get()
            if ops is None:
                return
            self._finish([op for op in ops if self._copy(op)])

    def exchange(self, op: Op, items: list[tuple], deadline: float) -> list | None:
        """Copy a small synchronous batch right here (see ``Transport.exchange``)."""
        desc = items[0][2]
        try:
            remote = self._remote_array(desc)
            for _, local, _, offset in items:
                self._move(op, local, remote, offset)
        except Exception as exc:  # a vanished file, a closed mapping
            logger.warning("shm transfer to %s failed: %s", desc.name, exc)
            err = TransferError(f"shared-memory copy to {desc.name} failed: {exc}")
            return [err] * len(items)
        if desc.owner_id != self.ctx.owner_id and not pid_alive(desc.pid):
            self.forget(desc)
            died = TransferError(f"owner of segment {desc.name} died during the copy")
            return [died] * len(items)
        return [None] * len(items)

    def _copy(self, op: PendingOp) -> bool:
        """Copy one op's bytes; False (and the op failed) if it could not."""
        if op.timed_out:
            op.fail(KVPoolTimeoutError(f"shm transfer to {op.desc.name} timed out in the queue"))
            return False
        try:
            self._move(op.op, op.local, self._remote_array(op.desc), op.remote_offset)
        except Exception as exc:  # a vanished file, a closed mapping: the op fails, we go on
            logger.warning("shm transfer to %s failed: %s", op.desc.name, exc)
            op.fail(TransferError(f"shared-memory copy to {op.desc.name} failed: {exc}"))
            return False
        return True

    @staticmethod
    def _move(op: Op, local: memoryview, remote: np.ndarray, offset: int) -> None:
        window = remote[offset : offset + len(local)]
        mine = np.frombuffer(local, dtype=np.uint8)
        if op is Op.READ:
            np.copyto(mine, window)
        else:
            np.copyto(window, mine)

    def _finish(self, copied: list[PendingOp]) -> None:
        """Report copied ops done, unless their segment's owner died meanwhile."""
        alive: dict[int, bool] = {}
        finished: list[PendingOp] = []
        for op in copied:
            pid = op.desc.pid
            if op.desc.owner_id != self.ctx.owner_id and pid not in alive:
                alive[pid] = pid_alive(pid)
            if not alive.get(pid, True):
                self.forget(op.desc)
                op.fail(TransferError(f"owner of segment {op.desc.name} died during the copy"))
            elif op.resolve(op.length):
                finished.append(op)
        if finished:
            finish_ops(finished)

    def _remote_array(self, desc: SegmentDescriptor) -> np.ndarray:
        if desc.owner_id == self.ctx.owner_id:
            seg = self.ctx.local_segment(desc.segment_id)
            if seg is None:
                raise TransferError(f"local segment {desc.name} is no longer registered")
            return seg.array
        assert desc.shm_name is not None
        with self._maps_lock:
            region = self._maps.get(desc.shm_name)
            if region is None:
                region = SharedRegion(desc.shm_name, desc.size, create=False)
                self._maps[desc.shm_name] = region
        return region.array

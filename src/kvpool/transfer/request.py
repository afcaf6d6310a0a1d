"""Transfer requests, their per-request status, and the handle of a submitted batch."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from kvpool.common.errors import KVPoolError, KVPoolTimeoutError, TransferError
from kvpool.transfer.protocol import Op
from kvpool.transfer.segment import SegmentDescriptor

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferRequest:
    """Move ``length`` bytes between a local buffer and a remote segment.

    READ copies remote -> local, WRITE local -> remote. ``local`` is any writable (for READ)
    buffer: a numpy array, a CPU tensor, a memoryview, a bytearray or a ``Segment``'s view.
    ``length`` defaults to the rest of the local buffer after ``local_offset``.
    """

    op: Op
    local: object
    remote: str
    remote_offset: int = 0
    length: int | None = None
    local_offset: int = 0


class State(Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferStatus(NamedTuple):
    """The outcome of one request: DONE only when every byte has moved."""

    state: State
    bytes_moved: int
    error: KVPoolError | None = None

    @property
    def ok(self) -> bool:
        return self.state is State.DONE

    @property
    def reason(self) -> str:
        return "" if self.error is None else str(self.error)


class PendingOp:
    """One request inside the engine: split into frames, finished when all frames resolve."""

    __slots__ = (
        "_error",
        "_frames_left",
        "_handle",
        "_lock",
        "bytes_moved",
        "conns",
        "deadline",
        "desc",
        "length",
        "limit",
        "local",
        "on_finish",
        "op",
        "reaper_key",
        "remote_offset",
        "started",
        "state",
        "sync",
        "timed_out",
        "transport",
    )

    def __init__(
        self,
        op: Op,
        local: memoryview,
        desc: SegmentDescriptor,
        remote_offset: int,
        handle: BatchHandle | None = None,
    ) -> None:
        self.op = op
        self.local = local
        self.desc = desc
        self.remote_offset = remote_offset
        self.length = len(local)
        self.bytes_moved = 0
        self.state = State.PENDING
        self.timed_out = False
        self.transport = ""
        self.conns: list = []
        self.deadline = 0.0
        self.started = 0.0
        self.on_finish: Callable[[list[PendingOp]], None] | None = None
        self.limit = None  # the engine's in-flight bound for this peer
        self.reaper_key = 0  # set while the engine's reaper watches its deadline
        self.sync = False  # its submitter waits right away (and may receive replies itself)
        self._frames_left = 1
        self._error: KVPoolError | None = None
        if handle is None:
            handle = BatchHandle()
            handle._add(self)
        self._handle = handle
        self._lock = handle._lock  # one lock per batch: ops of a batch rarely contend

    def set_frames(self, n: int) -> None:
        self._frames_left = n

    def resolve(self, nbytes: int, error: KVPoolError | None = None) -> bool:
        """Resolve one frame (successfully when ``error`` is None); True if that finished the
        op, and the caller must then pass it to ``finish_ops`` (with others, to batch hooks)."""
        with self._lock:
            if self.state is not State.PENDING:
                return False
            if error is None:
                self.bytes_moved += nbytes
            elif self._error is None:
                self._error = error
            self._frames_left -= 1
            if self._frames_left > 0:
                return False
            if self.timed_out and (self._error is not None or self.bytes_moved < self.length):
                self._error = KVPoolTimeoutError(f"transfer timed out ({self._describe()})")
            ok = self._error is None and self.bytes_moved == self.length
            if not ok and self._error is None:
                self._error = TransferError(f"partial transfer ({self._describe()})")
            self.state = State.DONE if ok else State.FAILED
            return True

    def frame_done(self, nbytes: int, error: KVPoolError | None = None) -> None:
        """``resolve`` one frame and run the completion hooks if that finished the op."""
        if self.resolve(nbytes, error):
            finish_ops([self])

    def fail(self, error: KVPoolError) -> None:
        """Resolve every remaining frame with ``error`` (no frame may still be running)."""
        with self._lock:
            left = self._frames_left
        if any([self.resolve(0, error) for _ in range(left)]):
            finish_ops([self])

    @property
    def error(self) -> KVPoolError | None:
        return self._error

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.bytes_moved, self._error)

    def _describe(self) -> str:
        return (
            f"{self.op.name} {self.length} B at {self.desc.name}+{self.remote_offset} "
            f"via {self.transport or '?'}, {self.bytes_moved} B moved"
        )


def finish_ops(ops: list[PendingOp]) -> None:
    """Completion hooks of ops that just finished: the engine's once per hook, each batch's
    counter once per handle (a train of replies costs a few lock round trips, not one per op)."""
    hook = ops[0].on_finish
    if len(ops) == 1:  # the common synchronous case: no grouping
        if hook is not None:
            hook(ops)
        handle = ops[0]._handle
        if handle is not None:
            handle._ops_finished(1)
        return
    if all(op.on_finish is hook for op in ops):
        if hook is not None:
            hook(ops)
    else:
        for op in ops:
            if op.on_finish is not None:
                op.on_finish([op])
    counts: dict[int, list] = {}
    for op in ops:
        handle = op._handle
        if handle is not None:
            entry = counts.get(id(handle))
            if entry is None:
                counts[id(handle)] = [handle, 1]
            else:
                entry[1] += 1
    for handle, n in counts.values():
        handle._ops_finished(n)


def _call_safely(fn: Callable[[BatchHandle], None], handle: BatchHandle) -> None:
    try:
        fn(handle)
    except Exception:  # a caller's callback must not break the transport thread running it
        logger.exception("transfer: a done-callback raised")


class BatchHandle:
    """A submitted batch: poll it, wait on it (threads or asyncio), read per-request status."""

    def __init__(self) -> None:
        self._ops: list[PendingOp] = []
        self._lock = threading.Lock()
        self._left = 0
        self._event: threading.Event | None = None  # made only if someone has to block
        self._callbacks: list[Callable[[BatchHandle], None]] = []

    def _add(self, op: PendingOp) -> None:
        self._ops.append(op)
        self._left += 1

    def _ops_finished(self, n: int) -> None:
        with self._lock:
            self._left -= n
            if self._left:
                return
            event, callbacks, self._callbacks = self._event, self._callbacks, []
        for op in self._ops:  # break the op <-> handle cycle: freed without the cyclic GC
            op._handle = None
        if event is not None:
            event.set()
        for cb in callbacks:
            _call_safely(cb, self)

    def done(self) -> bool:
        return self._left == 0

    def wait(self, timeout: float | None = None) -> list[TransferStatus]:
        """Block until every request has finished; raise ``KVPoolTimeoutError`` if it takes longer
        than ``timeout`` (the transfers themselves go on until their own deadline)."""
        with self._lock:
            if self._left:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
            else:
                event = None
        if event is not None and not event.wait(timeout):
            raise KVPoolTimeoutError(f"batch not finished after {timeout} s")
        return self.statuses()

    def statuses(self) -> list[TransferStatus]:
        return [op.status() for op in self._ops]

    def add_done_callback(self, fn: Callable[[BatchHandle], None]) -> None:
        """Call ``fn(handle)`` once every request has finished (now, if they already have)."""
        with self._lock:
            if self._left:
                self._callbacks.append(fn)
                return
        _call_safely(fn, self)

    async def wait_async(self, timeout: float | None = None) -> list[TransferStatus]:
        """``wait`` for asyncio: never blocks the event loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def wake(_: BatchHandle) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

        self.add_done_callback(wake)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError as exc:
            raise KVPoolTimeoutError(f"batch not finished after {timeout} s") from exc
        return self.statuses()

    def raise_for_status(self) -> None:
        """Raise the first failed request's error (a ``KVPoolError``)."""
        for op in self._ops:
            if op.state is State.FAILED and op.error is not None:
                raise op.error
        if not self.done():
            raise TransferError("batch still in flight")

    def __len__(self) -> int:
        return len(self._ops)

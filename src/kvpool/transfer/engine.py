"""The transfer engine: register segments, submit batches of READ/WRITE requests, wait on them.

>>> te = TransferEngine(TransferConfig(directory="memory"))
>>> seg = te.register("worker-0/kv", size=1 << 20)        # shared memory, published
>>> handle = te.submit([TransferRequest(Op.READ, buf, "worker-1/kv", remote_offset=4096)])
>>> handle.wait(timeout=5)                                  # [TransferStatus(DONE, ...)]

Requests are validated as a whole before anything moves (bad ones raise ``BadRequestError``,
unknown segments ``NotFoundError``); runtime failures (peer gone, refused, timed out) are
reported per request. Each peer gets the transport that reaches it best (shared memory on the
same host, TCP otherwise), a bound on in-flight bytes and a deadline per request. A small
synchronous batch to one peer (``transfer``) is moved by the calling thread itself when the
transport can (``Transport.exchange``): the per-call cost a store get or put pays.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterable

from kvpool.common.errors import (
    BackpressureError,
    BadRequestError,
    KVPoolTimeoutError,
    NotFoundError,
    TransferError,
)
from kvpool.config import TransferConfig
from kvpool.transfer import transports as _transports  # noqa: F401 - registers shm and tcp
from kvpool.transfer.flow import Inflight, Reaper
from kvpool.transfer.metadata import SegmentDirectory, open_directory
from kvpool.transfer.protocol import Op
from kvpool.transfer.quick import QuickPath
from kvpool.transfer.registry import SegmentRegistry
from kvpool.transfer.request import BatchHandle, PendingOp, State, TransferRequest, TransferStatus
from kvpool.transfer.segment import (
    Segment,
    SegmentDescriptor,
    boot_id,
    byte_view,
    reap_stale_shm,
)
from kvpool.transfer.stats import TransferStats
from kvpool.transfer.transports.base import TRANSPORTS, Transport, TransportContext
from kvpool.transfer.transports.tcp_server import TransferServer

logger = logging.getLogger(__name__)


class TransferEngine(QuickPath):
    """Moves bytes between this process's buffers and any registered segment."""

    def __init__(
        self, config: TransferConfig | None = None, directory: SegmentDirectory | None = None
    ) -> None:
        self.config = config or TransferConfig()
        cfg = self.config
        self.owner_id = uuid.uuid4().hex
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._descs: dict[str, SegmentDescriptor] = {}
        self._picks: dict[tuple[str, str], str] = {}  # (segment, mode) -> transport
        self._limits: dict[str, Inflight] = {}
        reap_stale_shm()
        self.directory = directory or open_directory(cfg.directory or "memory", cfg.segment_ttl,
                                                     cfg.auth_token)  # fmt: skip
        self.segments = SegmentRegistry(self.directory, self.owner_id)
        self._server = TransferServer(
            self.segments.by_id, cfg.host, cfg.port, cfg.auth_token, self.stats
        )
        self.host = cfg.advertise_host or (
            socket.gethostname() if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        )
        self.port = self._server.port
        self.segments.address = (self.host, self.port)
        ctx = TransportContext(cfg, self.stats, self.owner_id, boot_id(), self.segments.by_id)
        self._transports: dict[str, Transport] = {n: cls(ctx) for n, cls in TRANSPORTS.items()}
        self._reaper = Reaper(self._on_deadline)
        self._closed = False
        _LIVE.add(self)

    # -- segments (owned by self.segments) ----------------------------------------------------

    def register(
        self,
        name: str,
        buffer: object = None,
        *,
        size: int | None = None,
        shared: bool = True,
        path: str | None = None,
    ) -> Segment:
        """Register memory under a cluster-wide ``name`` and publish it (see
        ``SegmentRegistry.register``; ``path``: map that file, e.g. an SSD tier)."""
        return self.segments.register(name, buffer, size=size, shared=shared, path=path)

    def unregister(self, name: str) -> None:
        self.segments.unregister(name)

    def segment(self, name: str) -> Segment:
        return self.segments.get(name)

    def expect_owner(self, name: str, owner: str) -> None:
        """Forget the cached descriptor of ``name`` unless ``owner`` owns it (someone who knows
        says the segment now belongs to another process: a peer that restarted)."""
        desc = self._descs.get(name)
        if desc is not None and desc.owner_id != owner:
            self._forget(name)

    def resolve(self, name: str) -> SegmentDescriptor:
        """The descriptor of a segment anywhere in the cluster (cached until a failure)."""
        desc = self._descs.get(name)
        if desc is None:
            desc = self.directory.lookup(name)
            if desc is None:
                raise NotFoundError(f"segment {name!r} is not registered in the directory")
            self._descs[name] = desc
        return desc

    # -- transfers --------------------------------------------------------------------------

    def submit(
        self,
        requests: Iterable[TransferRequest],
        *,
        block: bool = True,
        timeout: float | None = None,
    ) -> BatchHandle:
        """Start a batch; returns at once with a handle (or waits for in-flight room when
        ``block``; raises ``BackpressureError`` when not ``block`` and a peer is saturated).
        ``timeout`` is each request's deadline in seconds (default ``request_timeout``)."""
        return self._submit(requests, block, timeout, sync=False)

    def _submit(
        self, requests: Iterable[TransferRequest], block: bool, timeout: float | None, sync: bool
    ) -> BatchHandle:
        if self._closed:
            raise TransferError("transfer engine is closed")
        views: dict[tuple[int, bool], memoryview] = {}  # one view per local buffer per batch
        handle = BatchHandle()
        for r in requests:
            op = self._prepare(r, views, handle)
            op.sync = sync
            handle._add(op)
        groups = self._group(handle._ops)
        deadline_s = timeout if timeout is not None else self.config.request_timeout
        self._admit(groups, block, deadline_s)
        now = time.monotonic()
        for op in handle._ops:
            op.started = now
            op.deadline = now + deadline_s
            op.on_finish = self._finished
        for transport, group in groups:
            transport.submit(group)
        if not handle.done():  # ops done inline (small shm copies) need no deadline
            self._reaper.add([op for op in handle._ops if op.state is State.PENDING])
        return handle

    def _group(self, ops: list[PendingOp]) -> list[tuple[Transport, list[PendingOp]]]:
        """Ops by (peer, transport)."""
        groups: dict[tuple[str, str], list[PendingOp]] = {}
        mode = self.config.transport
        for op in ops:
            pick = self._picks.get((op.desc.name, mode))
            if pick is None:
                pick = self._picks[(op.desc.name, mode)] = self._pick(op.desc)
            groups.setdefault((op.desc.owner_id, pick), []).append(op)
        return [(self._transports[t], group) for (_, t), group in groups.items()]

    def _admit(
        self, groups: list[tuple[Transport, list[PendingOp]]], block: bool, timeout: float
    ) -> None:
        """Take in-flight room per peer (all or nothing); groups the transport moves inline,
        within ``submit`` itself, never count as in flight."""
        acquired: list[tuple[Inflight, int]] = []
        try:
            for transport, group in groups:
                n = sum(op.length for op in group)
                if transport.is_inline(n):
                    continue
                limit = self._limit(group[0].desc.owner_id)
                limit.acquire(n, block, timeout, group[0].desc.host)
                acquired.append((limit, n))
                for op in group:
                    op.limit = limit
        except BackpressureError:
            for limit, n in acquired:
                limit.release(n)
            self.stats.error("backpressure")
            raise
        if acquired:
            self.stats.add_inflight(sum(n for _, n in acquired))

    def transfer(
        self, requests: Iterable[TransferRequest], timeout: float | None = None
    ) -> list[TransferStatus]:
        """Submit and wait; raise the first failure (a ``KVPoolError``). The calling thread
        receives its own replies where it can (fewer thread hand-offs than submit + wait)."""
        statuses = self.transfer_statuses(requests, timeout)
        for status in statuses:
            if status.error is not None:
                raise status.error
        return statuses

    def transfer_statuses(
        self, requests: Iterable[TransferRequest], timeout: float | None = None
    ) -> list[TransferStatus]:
        """``transfer`` without raising: every request's status (for batches where some may
        fail on their own)."""
        requests = requests if isinstance(requests, list) else list(requests)
        quick = self._quick(requests, timeout)
        if quick is not None:
            return quick
        handle = self._submit(requests, True, timeout, sync=True)
        if not handle.done():
            for name in {op.transport for op in handle._ops}:
                self._transports[name].drive(handle)
        return handle.wait()

    def read(self, local, remote: str, remote_offset: int = 0, **kw) -> int:
        """READ ``remote`` into ``local``; the number of bytes moved (raises on failure)."""
        timeout = kw.pop("timeout", None)
        req = TransferRequest(Op.READ, local, remote, remote_offset, **kw)
        return self.transfer([req], timeout)[0].bytes_moved

    def write(self, local, remote: str, remote_offset: int = 0, **kw) -> int:
        """WRITE ``local`` into ``remote``; the number of bytes moved (raises on failure)."""
        timeout = kw.pop("timeout", None)
        req = TransferRequest(Op.WRITE, local, remote, remote_offset, **kw)
        return self.transfer([req], timeout)[0].bytes_moved

    async def transfer_async(
        self, requests: list[TransferRequest], timeout: float | None = None
    ) -> list[TransferStatus]:
        """``submit`` + wait without blocking the event loop; per-request statuses."""
        loop = asyncio.get_running_loop()
        handle = await loop.run_in_executor(None, lambda: self.submit(requests, timeout=timeout))
        return await handle.wait_async()

    def _prepare(
        self, req: TransferRequest, views: dict[tuple[int, bool], memoryview], handle: BatchHandle
    ) -> PendingOp:
        op, local, desc, offset = self._check(req, views)
        return PendingOp(op, local, desc, offset, handle)

    def _check(
        self, req: TransferRequest, views: dict[tuple[int, bool], memoryview]
    ) -> tuple[Op, memoryview, SegmentDescriptor, int]:
        """``(op, local range, remote descriptor, remote offset)`` of a request, validated
        (``views``: one view per local buffer of a batch)."""
        op = req.op if type(req.op) is Op else _parse_op(req.op)
        key = (id(req.local), op is Op.READ)
        view = views.get(key)
        if view is None:
            view = views[key] = byte_view(req.local, writable=op is Op.READ)
        start = req.local_offset
        length = len(view) - start if req.length is None else req.length
        if start < 0 or length < 1 or start + length > len(view):
            raise BadRequestError(
                f"local range [{start}, {start + length}) outside the {len(view)}-byte buffer "
                "(length must be >= 1)"
            )
        desc = self.resolve(req.remote)
        if req.remote_offset < 0 or req.remote_offset + length > desc.size:
            raise BadRequestError(
                f"remote range [{req.remote_offset}, {req.remote_offset + length}) outside "
                f"segment {desc.name!r} of {desc.size} bytes"
            )
        return op, view[start : start + length], desc, req.remote_offset

    def _pick(self, desc: SegmentDescriptor) -> str:
        choice = self.config.transport
        if choice == "auto":
            return "shm" if self._transports["shm"].can_reach(desc) else "tcp"
        if not self._transports[choice].can_reach(desc):
            raise BadRequestError(f"segment {desc.name!r} is not reachable over {choice}")
        return choice

    def _limit(self, owner: str) -> Inflight:
        with self._lock:
            limit = self._limits.get(owner)
            if limit is None:
                limit = self._limits[owner] = Inflight(int(self.config.max_inflight_bytes))
            return limit

    def _finished(self, ops: list[PendingOp]) -> None:
        """Completion hook of finished ops: deadlines, in-flight room, stats (batched)."""
        if ops[0].reaper_key or len(ops) > 1:
            self._reaper.discard(ops)
        releases: dict[int, list] = {}
        now = time.monotonic()
        done = []
        for op in ops:
            counted = op.limit is not None
            if counted:
                entry = releases.setdefault(id(op.limit), [op.limit, 0])
                entry[1] += op.length
            if op.state is State.DONE:
                direction = "read" if op.op is Op.READ else "write"
                done.append((op.transport, direction, op.length, now - op.started, counted))
            else:
                self._failed(op, counted)
        for limit, n in releases.values():
            limit.release(n)
        if done:
            self.stats.finished(done)

    def _failed(self, op: PendingOp, counted: bool) -> None:
        if counted:
            self.stats.add_inflight(-op.length)
        self._count_failure(op.error, op.desc.name)

    def _count_failure(self, err: Exception | None, name: str) -> None:
        kind = type(err).__name__ if err is not None else "unknown"
        self.stats.error(
            "timeout" if isinstance(err, KVPoolTimeoutError) else _ERROR_KINDS.get(kind, "transfer")
        )
        if isinstance(err, TransferError | NotFoundError):
            self._forget(name)  # re-resolve: the peer may have moved

    def _forget(self, name: str) -> None:
        self._descs.pop(name, None)
        for key in [k for k in self._picks if k[0] == name]:
            self._picks.pop(key, None)

    def _on_deadline(self, op: PendingOp) -> None:
        if op.state is State.PENDING:
            logger.warning("transfer: %s to %s missed its deadline", op.op.name, op.desc.name)
            self._transports[op.transport or "tcp"].cancel(op)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, fail what is in flight, withdraw and free every segment."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        for transport in self._transports.values():
            transport.close()
        self._reaper.close()
        self.directory.close()
        self.segments.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_LIVE: weakref.WeakSet[TransferEngine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit: withdraw descriptors and remove this process's shm files."""
    for engine in list(_LIVE):
        try:
            engine.close()
        except Exception:  # exiting anyway: never mask the real exit status
            logger.debug("transfer: closing an engine at exit failed", exc_info=True)


def _parse_op(value: object) -> Op:
    try:
        return Op[value.upper()] if isinstance(value, str) else Op(value)
    except (KeyError, ValueError) as exc:
        raise BadRequestError(f"op must be READ or WRITE, got {value!r}") from exc


_ERROR_KINDS = {"BadRequestError": "bounds", "NotFoundError": "not_found"}

"""The transfer engine: register segments, submit batches of READ/WRITE requests, wait on them.

>>> te = TransferEngine(TransferConfig(directory="memory"))
>>> seg = te.register("worker-0/kv", size=1 << 20)        # shared memory, published
>>> handle = te.submit([TransferRequest(Op.READ, buf, "worker-1/kv", remote_offset=4096)])
>>> handle.wait(timeout=5)                                  # [TransferStatus(DONE, ...)]

Requests are validated as a whole before anything moves (bad ones raise ``BadRequestError``,
unknown segments ``NotFoundError``); runtime failures (peer gone, refused, timed out) are
reported per request. Each peer gets the transport that reaches it best (shared memory on the
same host, TCP otherwise), a bound on in-flight bytes and a deadline per request.
"""

from __future__ import annotations

import asyncio
import atexit
import heapq
import logging
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterable

import numpy as np

from kvpool.common.errors import (
    AlreadyExistsError,
    BackpressureError,
    BadRequestError,
    KVPoolTimeoutError,
    NotFoundError,
    TransferError,
)
from kvpool.config import TransferConfig
from kvpool.transfer import transports as _transports  # noqa: F401 - registers shm and tcp
from kvpool.transfer.metadata import SegmentDirectory, open_directory
from kvpool.transfer.protocol import Op
from kvpool.transfer.request import BatchHandle, PendingOp, State, TransferRequest, TransferStatus
from kvpool.transfer.segment import (
    Segment,
    SegmentDescriptor,
    SharedRegion,
    boot_id,
    byte_view,
    new_shm_name,
    pid_alive,
    reap_stale_shm,
)
from kvpool.transfer.stats import TransferStats
from kvpool.transfer.transports.base import TRANSPORTS, Transport, TransportContext
from kvpool.transfer.transports.tcp_server import TransferServer

logger = logging.getLogger(__name__)


class _Inflight:
    """Bytes in flight to one peer, bounded (a single oversized batch may pass when idle)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waiters = 0
        self._cond = threading.Condition(threading.Lock())

    def acquire(self, n: int, block: bool, timeout: float, peer: str) -> None:
        with self._cond:
            ok = self.used == 0 or self.used + n <= self.limit
            if not ok and block:
                self.waiters += 1
                try:
                    ok = self._cond.wait_for(
                        lambda: self.used == 0 or self.used + n <= self.limit, timeout
                    )
                finally:
                    self.waiters -= 1
            if not ok:
                raise BackpressureError(
                    f"{self.used} bytes already in flight to {peer} (limit {self.limit}); "
                    f"{n} more would exceed it"
                )
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            if self.waiters:
                self._cond.notify_all()


class _Reaper:
    """Cancels requests that pass their deadline (one thread per engine)."""

    def __init__(self, on_deadline) -> None:
        # The heap holds (deadline, key) only; ops live in `_live` until they finish, so a
        # finished op is freed at once (no long-lived garbage for the cyclic GC to walk).
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, PendingOp] = {}
        self._cond = threading.Condition(threading.Lock())
        self._seq = 0
        self._closed = False
        self._on_deadline = on_deadline
        self._thread = threading.Thread(
            target=self._run, name="kvpool-transfer-reaper", daemon=True
        )
        self._thread.start()

    def add(self, ops: list[PendingOp]) -> None:
        with self._cond:
            earliest = self._heap[0][0] if self._heap else float("inf")
            for op in ops:
                self._seq += 1
                op.reaper_key = self._seq
                self._live[self._seq] = op
                heapq.heappush(self._heap, (op.deadline, self._seq))
            if len(self._heap) > 4 * len(self._live) + 1024:  # drop stale keys (amortized)
                self._heap = [e for e in self._heap if e[1] in self._live]
                heapq.heapify(self._heap)
            if self._heap and self._heap[0][0] < earliest:  # wake it only to sleep less
                self._cond.notify()

    def discard(self, ops: list[PendingOp]) -> None:
        """Forget finished ops (their heap keys go stale)."""
        keys = [op.reaper_key for op in ops if op.reaper_key]
        if keys:
            with self._cond:
                for key in keys:
                    self._live.pop(key, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    while self._heap and self._heap[0][1] not in self._live:
                        heapq.heappop(self._heap)
                    delay = self._heap[0][0] - time.monotonic() if self._heap else None
                    if delay is not None and delay <= 0:
                        break
                    self._cond.wait(delay)
                if self._closed:
                    return
                op = self._live.pop(heapq.heappop(self._heap)[1])
            self._on_deadline(op)


class TransferEngine:
    """Moves bytes between this process's buffers and any registered segment."""

    def __init__(
        self, config: TransferConfig | None = None, directory: SegmentDirectory | None = None
    ) -> None:
        self.config = config or TransferConfig()
        cfg = self.config
        self.owner_id = uuid.uuid4().hex
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._by_id: dict[int, Segment] = {}
        self._by_name: dict[str, Segment] = {}
        self._next_id = 1
        self._descs: dict[str, SegmentDescriptor] = {}
        self._picks: dict[tuple[str, str], str] = {}  # (segment, mode) -> transport
        self._limits: dict[str, _Inflight] = {}
        reap_stale_shm()
        self.directory = directory or open_directory(cfg.directory, cfg.segment_ttl, cfg.auth_token)
        self._server = TransferServer(self._local, cfg.host, cfg.port, cfg.auth_token, self.stats)
        self.host = cfg.advertise_host or (
            socket.gethostname() if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        )
        self.port = self._server.port
        ctx = TransportContext(cfg, self.stats, self.owner_id, boot_id(), self._local)
        self._transports: dict[str, Transport] = {n: cls(ctx) for n, cls in TRANSPORTS.items()}
        self._reaper = _Reaper(self._on_deadline)
        self._closed = False
        _LIVE.add(self)

    # -- segments ---------------------------------------------------------------------------

    def register(
        self, name: str, buffer: object = None, *, size: int | None = None, shared: bool = True
    ) -> Segment:
        """Register memory under a cluster-wide ``name`` and publish it.

        Without ``buffer``, allocates ``size`` bytes (in shared memory unless ``shared`` is
        False, so same-host peers copy without sockets). With ``buffer`` (numpy array, CPU
        tensor, bytearray...), registers that memory as is: peers reach it over TCP.
        """
        if not name or len(name) > 255 or "\0" in name:
            raise BadRequestError("a segment name must be 1..255 characters, no NUL")
        region = None
        if buffer is None:
            if size is None or size <= 0:
                raise BadRequestError("register() needs a buffer or a size > 0")
            if shared:
                region = SharedRegion(new_shm_name(name), size, create=True)
                view = memoryview(region.mmap)
            else:
                buffer = np.zeros(size, dtype=np.uint8)
        if region is None:
            view = byte_view(buffer, writable=True)
            if len(view) == 0:
                raise BadRequestError("cannot register an empty buffer")
        with self._lock:
            if name in self._by_name:
                raise BadRequestError(f"segment {name!r} is already registered here")
            seg = Segment(name, self._next_id, view, region, keep=buffer)
            self._next_id += 1
            self._by_id[seg.segment_id] = seg
            self._by_name[name] = seg
        try:
            self._publish(self._descriptor(seg))
        except BaseException:
            self._drop(seg)
            raise
        return seg

    def _publish(self, desc: SegmentDescriptor) -> None:
        """Publish; take the name over if its previous owner is dead (a restarted worker)."""
        try:
            self.directory.publish(desc)
            return
        except AlreadyExistsError:
            old = self.directory.lookup(desc.name)
            if old is None or not owner_is_dead(old):
                raise
        logger.info("segment %s: previous owner %s is gone, taking over", desc.name, old.owner_id)
        self.directory.evict(old)
        self.directory.publish(desc)

    def unregister(self, name: str) -> None:
        with self._lock:
            seg = self._by_name.get(name)
        if seg is None:
            raise NotFoundError(f"segment {name!r} is not registered here")
        self.directory.withdraw(name)
        self._drop(seg)

    def segment(self, name: str) -> Segment:
        with self._lock:
            seg = self._by_name.get(name)
        if seg is None:
            raise NotFoundError(f"segment {name!r} is not registered here")
        return seg

    def _drop(self, seg: Segment) -> None:
        with self._lock:
            self._by_id.pop(seg.segment_id, None)
            self._by_name.pop(seg.name, None)
        seg.close()

    def _local(self, segment_id: int) -> Segment | None:
        return self._by_id.get(segment_id)

    def _descriptor(self, seg: Segment) -> SegmentDescriptor:
        import os

        return SegmentDescriptor(
            name=seg.name,
            size=seg.size,
            host=self.host,
            port=self.port,
            segment_id=seg.segment_id,
            owner_id=self.owner_id,
            pid=os.getpid(),
            boot_id=boot_id(),
            shm_name=seg.shm_name,
        )

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
        acquired: list[tuple[_Inflight, int]] = []
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
        handle = self._submit(requests, True, timeout, sync=True)
        if not handle.done():
            for name in {op.transport for op in handle._ops}:
                self._transports[name].drive(handle)
        statuses = handle.wait()
        handle.raise_for_status()
        return statuses

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
        return PendingOp(op, view[start : start + length], desc, req.remote_offset, handle)

    def _pick(self, desc: SegmentDescriptor) -> str:
        choice = self.config.transport
        if choice == "auto":
            return "shm" if self._transports["shm"].can_reach(desc) else "tcp"
        if not self._transports[choice].can_reach(desc):
            raise BadRequestError(f"segment {desc.name!r} is not reachable over {choice}")
        return choice

    def _limit(self, owner: str) -> _Inflight:
        with self._lock:
            limit = self._limits.get(owner)
            if limit is None:
                limit = self._limits[owner] = _Inflight(int(self.config.max_inflight_bytes))
            return limit

    def _finished(self, ops: list[PendingOp]) -> None:
        """Completion hook of finished ops: deadlines, in-flight room, stats (batched)."""
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
        err = op.error
        kind = type(err).__name__ if err is not None else "unknown"
        self.stats.error(
            "timeout" if isinstance(err, KVPoolTimeoutError) else _ERROR_KINDS.get(kind, "transfer")
        )
        if isinstance(err, TransferError | NotFoundError):
            self._forget(op.desc.name)  # re-resolve: the peer may have moved

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
        with self._lock:
            segments = list(self._by_id.values())
        for seg in segments:
            self._drop(seg)

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


def owner_is_dead(desc: SegmentDescriptor, timeout: float = 1.0) -> bool:
    """Whether the process that published ``desc`` is gone (same host: its pid; otherwise its
    transfer server refuses connections)."""
    if desc.boot_id == boot_id():
        return not pid_alive(desc.pid)
    try:
        socket.create_connection((desc.host, desc.port), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # unreachable is not dead: a network problem must not steal names
    return False


_ERROR_KINDS = {"BadRequestError": "bounds", "NotFoundError": "not_found"}

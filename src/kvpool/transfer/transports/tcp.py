"""TCP transport (client side): striped, pipelined, coalesced frames to a peer's server.

Per peer a small pool of connections, opened on demand and reused. A request larger than
``slice_bytes`` becomes several frames spread round-robin over the pool; each connection's
sender thread takes everything queued and sends it as one frame train with one scatter/gather
``sendmsg`` (many small requests: one syscall), and its receiver thread reads the responses
in order, READ payloads straight into the destination buffer. A broken connection resolves
every frame it carried as failed (only after its receiver has stopped writing into buffers),
and the next submit dials again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections import deque

from kvpool.common.errors import (
    BadRequestError,
    KVPoolError,
    KVPoolTimeoutError,
    NotFoundError,
    TransferError,
)
from kvpool.transfer import protocol as P
from kvpool.transfer.request import PendingOp, finish_ops
from kvpool.transfer.segment import SegmentDescriptor
from kvpool.transfer.transports.base import Transport, TransportContext, register_transport

logger = logging.getLogger(__name__)

TRAIN_FRAMES = 512
TRAIN_BYTES = 32 << 20
CHUNK_FRAMES = 32


class _Frame:
    __slots__ = ("length", "local", "offset", "op", "req_id", "seg_id")

    def __init__(self, op: PendingOp, local: memoryview, offset: int) -> None:
        self.op = op
        self.local = local
        self.offset = offset
        self.length = len(local)
        self.seg_id = op.desc.segment_id
        self.req_id = 0


class _Connection:
    """One socket with a sender and a receiver thread; frames are answered in order."""

    def __init__(self, sock: socket.socket, peer: str, inline_bytes: int) -> None:
        self.sock = sock
        self.peer = peer
        self.inline_bytes = inline_bytes
        self._cond = threading.Condition()  # sender and receiver both wait on it: notify_all
        self._send_lock = threading.Lock()  # whoever holds it sends (frame order = send order)
        self._queue: deque[_Frame] = deque()
        self._queued_payload = 0
        self._trains: deque[list[_Frame]] = deque()  # sent, awaiting replies, in order
        self._ids = itertools.count(1)
        self.dead = False
        self.reason = ""
        self._sender = threading.Thread(target=self._send_loop, name="kvpool-tcp-send", daemon=True)
        self._receiver = threading.Thread(
            target=self._recv_loop, name="kvpool-tcp-recv", daemon=True
        )
        self._sender.start()
        self._receiver.start()

    def enqueue(self, frames: list[_Frame]) -> bool:
        """Queue frames; False if the connection is already dead (the caller redials).

        A small train (READ headers, small WRITEs) is sent right here by the submitting thread
        when nobody else is sending: no hand-off to the sender thread on the hot path.
        """
        payload = sum(f.length for f in frames if f.op.op is P.Op.WRITE)
        with self._cond:
            if self.dead:
                return False
            self._queue.extend(frames)
            self._queued_payload += payload
            small = self._queued_payload <= self.inline_bytes
            if not small:
                self._cond.notify_all()
        if small and self._send_lock.acquire(blocking=False):
            try:
                self._drain()
            except OSError as exc:
                self.abort(f"send failed: {exc}")
            finally:
                self._send_lock.release()
            with self._cond:
                if self._queue:  # raced with another submitter: the sender takes over
                    self._cond.notify_all()
        elif small:
            with self._cond:
                self._cond.notify_all()
        return True

    def abort(self, reason: str) -> None:
        """Break the connection; the receiver then fails everything it carried."""
        with self._cond:
            if not self.reason:
                self.reason = reason
            self.dead = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _send_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self.dead:
                        self._cond.wait()
                    if self.dead:
                        return
                with self._send_lock:
                    self._drain()
        except OSError as exc:
            self.abort(f"send failed: {exc}")

    def _drain(self) -> None:
        """Send queued frames as trains until the queue is empty (caller holds the send lock)."""
        while True:
            with self._cond:
                if self.dead or not self._queue:
                    return
                train = self._take_train()
            self._send(train)

    def _take_train(self) -> list[_Frame]:
        train: list[_Frame] = []
        nbytes = 0
        while self._queue and len(train) < TRAIN_FRAMES and nbytes < TRAIN_BYTES:
            frame = self._queue.popleft()
            frame.req_id = next(self._ids)
            train.append(frame)
            nbytes += frame.length
            if frame.op.op is P.Op.WRITE:
                self._queued_payload -= frame.length
        self._trains.append(train)
        self._cond.notify_all()  # the receiver waits for a train to expect
        return train

    def _send(self, train: list[_Frame]) -> None:
        """One ``sendmsg``: headers packed side by side in one buffer, WRITE payloads between."""
        size = P.REQUEST.size
        heads = bytearray(size * len(train))
        hview = memoryview(heads)
        bufs: list = []
        run = 0  # start of the headers not yet listed
        last = len(train) - 1
        for i, f in enumerate(train):
            flags = P.FLAG_END if i == last else 0
            P.REQUEST.pack_into(
                heads, i * size, f.op.op, flags, 0, f.seg_id, f.req_id, f.offset, f.length
            )
            if f.op.op is P.Op.WRITE:
                bufs.append(hview[run : (i + 1) * size])
                bufs.append(f.local)
                run = (i + 1) * size
        if run < len(heads):
            bufs.append(hview[run:])
        P.sendmsg_all(self.sock, bufs)

    def _recv_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._trains and not self.dead:
                        self._cond.wait()
                    if self.dead:
                        return
                    train = self._trains[0]  # stays listed until received (or failed with it)
                self._receive_train(train)
                with self._cond:
                    self._trains.popleft()
        except (OSError, ConnectionError) as exc:
            self.abort(str(exc) or type(exc).__name__)
        except Exception as exc:  # a malformed response (or a bug): drop this connection
            logger.warning("transfer: bad response from %s: %r", self.peer, exc)
            self.abort(f"bad response: {exc}")
        finally:
            self._fail_all()
            self.sock.close()

    def _receive_train(self, train: list[_Frame]) -> None:
        """Every reply of a train in one scatter read (replies have predictable sizes: a READ
        reply always carries ``length`` bytes), READ payloads straight into their buffers."""
        heads = memoryview(bytearray(P.RESPONSE.size * len(train)))
        views: list[memoryview] = []
        for i, frame in enumerate(train):
            views.append(heads[i * P.RESPONSE.size : (i + 1) * P.RESPONSE.size])
            if frame.op.op is P.Op.READ:
                views.append(frame.local)
        P.recvmsg_exact(self.sock, views)
        results = []
        for i, frame in enumerate(train):
            status, op, _, _, req_id, length = P.RESPONSE.unpack_from(heads, i * P.RESPONSE.size)
            want = frame.length if op == P.Op.READ else 0
            if frame.req_id != req_id or op != frame.op.op or length != want:
                raise P.FrameError(f"unexpected reply (request {req_id}, length {length})")
            results.append(None if status == P.Status.OK else _status_error(status, frame))
        finished = [
            frame.op
            for frame, error in zip(train, results, strict=True)
            if frame.op.resolve(0 if error else frame.length, error)
        ]
        if finished:
            finish_ops(finished)

    def _fail_all(self) -> None:
        with self._cond:
            self.dead = True
            frames = [f for train in self._trains for f in train] + list(self._queue)
            self._trains.clear()
            self._queue.clear()
        self._sender.join(timeout=10)  # senders must stop reading WRITE buffers first
        if self._send_lock.acquire(timeout=10):
            self._send_lock.release()
        err = TransferError(f"connection to {self.peer} lost: {self.reason}")
        finished = [frame.op for frame in frames if frame.op.resolve(0, err)]
        if finished:
            finish_ops(finished)


def _status_error(status: int, frame: _Frame) -> Exception:
    text = P.STATUS_TEXT.get(status, f"status {status}")  # type: ignore[call-overload]
    msg = f"peer refused {frame.op.op.name} of {frame.op.desc.name}: {text}"
    if status == P.Status.OUT_OF_BOUNDS:
        return BadRequestError(msg)
    if status == P.Status.UNKNOWN_SEGMENT:
        return NotFoundError(msg)
    return TransferError(msg)


@register_transport("tcp")
class TcpTransport(Transport):
    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._pools: dict[tuple[str, int], list[_Connection]] = {}
        self._lock = threading.Lock()
        self._rr = itertools.count()

    def can_reach(self, desc: SegmentDescriptor) -> bool:
        return desc.port > 0

    def submit(self, ops: list[PendingOp]) -> None:
        frames = self._slice(ops)
        peer = (ops[0].desc.host, ops[0].desc.port)
        budget = min(op.deadline for op in ops) - time.monotonic()
        sliced = len(frames) - len(ops)  # > 0 when large requests were cut into frames
        want = min(self.ctx.config.num_streams, max(1, sliced + 1))
        try:
            conns = self._connections(peer, want, budget)
        except (OSError, TransferError) as exc:
            self.ctx.stats.error("connect")
            err: KVPoolError = TransferError(
                f"cannot reach transfer peer {peer[0]}:{peer[1]}: {exc or type(exc).__name__}"
            )
            if isinstance(exc, TimeoutError):
                err = KVPoolTimeoutError(f"connecting to {peer[0]}:{peer[1]} timed out")
            for op in ops:
                op.fail(err)
            return
        # Frames of large (sliced) requests are striped over the connections; whole small
        # requests stay together on one connection, so they travel as one train.
        per_conn: list[list[_Frame]] = [[] for _ in conns]
        start = next(self._rr)
        home = start % len(conns)
        for i, frame in enumerate(frames):
            k = (start + i) % len(conns) if frame.length < frame.op.length else home
            per_conn[k].append(frame)
            if not frame.op.conns or frame.op.conns[-1] is not conns[k]:
                frame.op.conns.append(conns[k])
        # Trains of CHUNK frames: the peer starts answering while later frames are packed.
        for a in range(0, max(map(len, per_conn)), CHUNK_FRAMES):
            for conn, group in zip(conns, per_conn, strict=True):
                part = group[a : a + CHUNK_FRAMES]
                if part and not conn.enqueue(part):
                    err = TransferError(f"connection to {conn.peer} lost: {conn.reason}")
                    for frame in part:
                        frame.op.frame_done(0, err)

    def cancel(self, op: PendingOp) -> None:
        op.timed_out = True
        for conn in list(op.conns):
            conn.abort("a request on this connection timed out")

    def forget(self, desc: SegmentDescriptor) -> None:
        with self._lock:
            conns = self._pools.pop((desc.host, desc.port), [])
        for conn in conns:
            conn.abort("peer forgotten")

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for conns in pools:
            for conn in conns:
                conn.abort("transfer engine closed")

    def _slice(self, ops: list[PendingOp]) -> list[_Frame]:
        step = int(self.ctx.config.slice_bytes)
        frames: list[_Frame] = []
        for op in ops:
            op.transport = self.name
            if op.length <= step:  # the common case: one frame, no slicing
                frames.append(_Frame(op, op.local, op.remote_offset))
                continue
            n = -(-op.length // step)
            op.set_frames(n)
            for k in range(n):
                a = k * step
                frames.append(_Frame(op, op.local[a : a + step], op.remote_offset + a))
        return frames

    def _connections(self, peer: tuple[str, int], want: int, budget: float) -> list[_Connection]:
        """``want`` live connections to ``peer`` (dialing within ``budget`` seconds; with one
        live connection, a failed extra dial just means less striping)."""
        with self._lock:
            conns = [c for c in self._pools.get(peer, []) if not c.dead]
            self._pools[peer] = conns
            missing = want - len(conns)
        fresh = []
        timeout = max(0.01, min(self.ctx.config.connect_timeout, budget))
        for _ in range(max(0, missing)):
            try:
                fresh.append(self._dial(peer, timeout))
            except (OSError, TransferError):
                if not conns and not fresh:
                    raise
                logger.info("transfer: extra connection to %s:%s failed; striping less", *peer)
                break
        with self._lock:
            conns = self._pools.setdefault(peer, [])
            conns.extend(fresh)
            live = [c for c in conns if not c.dead]
        if not live:
            raise TransferError("no live connection")
        return live[: max(want, 1)]

    def _dial(self, peer: tuple[str, int], timeout: float) -> _Connection:
        cfg = self.ctx.config
        sock = socket.create_connection(peer, timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            token = (cfg.auth_token or "").encode()
            sock.sendall(P.HELLO.pack(P.MAGIC, P.VERSION, len(token)) + token)
            reply = bytearray(P.WELCOME.size)
            P.recv_exact(sock, memoryview(reply))
            magic, status = P.WELCOME.unpack(reply)
            if magic != P.MAGIC:
                raise TransferError(f"{peer[0]}:{peer[1]} is not a kvpool transfer server")
            if status != P.Status.OK:
                text = P.STATUS_TEXT.get(status, str(status))  # type: ignore[call-overload]
                raise TransferError(f"{peer[0]}:{peer[1]} refused the handshake: {text}")
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock, f"{peer[0]}:{peer[1]}", int(cfg.tcp_inline_bytes))

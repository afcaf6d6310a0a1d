"""One client TCP connection of the transfer engine: frame trains out, reply trains in.

Sending: whoever holds the send lock drains the queue as trains (one ``sendmsg`` each): the
submitting thread itself for small trains, the connection's sender thread otherwise.

Receiving: replies come back in train order with predictable sizes, so one scatter read takes
a whole train. One thread at a time holds the *reader role*: the connection's receiver thread
while asynchronous trains are pending, or a thread that waits for its own synchronous batch
(``drive``), which then reads its replies itself and skips two thread hand-offs per request.

The quick exchange: a synchronous caller with a small batch that finds the connection idle
takes both roles at once (``claim``), sends its train and receives the replies itself
(``exchange``): no queue, no frame objects, no deadline heap; the socket's kernel timeouts
(``STALL_CHECK_S``) let it notice its deadline.

A broken connection resolves every frame it carried as failed, only once no thread can still
be writing into (or sending from) the buffers of those frames.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from kvpool.common.errors import BadRequestError, KVPoolTimeoutError, NotFoundError, TransferError
from kvpool.common.net import spin_until_readable
from kvpool.transfer import protocol as P
from kvpool.transfer.request import BatchHandle, PendingOp, finish_ops

logger = logging.getLogger(__name__)

TRAIN_FRAMES = 512
TRAIN_BYTES = 32 << 20
STALL_CHECK_S = 0.25  # a blocked send or receive returns this often to look at its deadline


class Frame:
    """A slice of one request on the wire (a whole request unless it was sliced)."""

    __slots__ = ("length", "local", "offset", "op", "req_id", "seg_id", "sync")

    def __init__(self, op: PendingOp, local: memoryview, offset: int) -> None:
        self.op = op
        self.local = local
        self.offset = offset
        self.length = len(local)
        self.seg_id = op.desc.segment_id
        self.req_id = 0
        self.sync = False  # its submitter will receive the reply itself (see drive)


class Connection:
    """One socket, a sender and a receiver thread, and the reader role."""

    def __init__(self, sock: socket.socket, peer: str, inline_bytes: int,
                 spin_s: float = 0.0) -> None:  # fmt: skip
        self.sock = sock
        self.peer = peer
        self.inline_bytes = inline_bytes
        self.spin_s = spin_s  # an exchange polls this long for its replies before it sleeps
        # One lock, one condition per kind of waiter, so a wake-up wakes only who can act.
        self._lock = threading.Lock()
        self._send_cv = threading.Condition(self._lock)  # the sender thread: frames queued
        self._recv_cv = threading.Condition(self._lock)  # the receiver: async trains to read
        self._role_cv = threading.Condition(self._lock)  # drivers and _fail_all: role/trains
        self._send_lock = threading.Lock()  # whoever holds it sends (frame order = send order)
        self._queue: deque[Frame] = deque()
        self._queued_payload = 0
        self._trains: deque[tuple[list[Frame], bool]] = deque()  # (train, has async frames)
        self._async_trains = 0
        self._reading = False  # the reader role is taken
        self._ids = itertools.count(1)
        self.dead = False
        self.reason = ""
        self._sender = threading.Thread(target=self._send_loop, name="kvpool-tcp-send", daemon=True)
        self._receiver = threading.Thread(
            target=self._recv_loop, name="kvpool-tcp-recv", daemon=True
        )
        self._sender.start()
        self._receiver.start()

    # -- sending ------------------------------------------------------------------------------

    def enqueue(self, frames: list[Frame], sync: bool = False) -> bool:
        """Queue frames; False if the connection is already dead (the caller redials).

        A small train is sent right here by the submitting thread when nobody else is sending.
        ``sync``: the submitter will ``drive`` the connection to read the replies (only honoured
        for frames sent that way; others are left to the receiver thread).
        """
        payload = sum(f.length for f in frames if f.op.op is P.Op.WRITE)
        with self._lock:
            if self.dead:
                return False
            small = self._queued_payload + payload <= self.inline_bytes
            for f in frames:
                f.sync = sync and small
            self._queue.extend(frames)
            self._queued_payload += payload
            if not small:
                self._send_cv.notify()
        if small and self._send_lock.acquire(blocking=False):
            try:
                self._drain()
            except OSError as exc:
                self.abort(f"send failed: {exc}")
            finally:
                self._send_lock.release()
        with self._lock:
            if self._queue:  # raced with another sender: the sender thread takes over
                self._send_cv.notify()
        return True

    def abort(self, reason: str) -> None:
        """Break the connection; the receiver thread then fails everything it carried."""
        with self._lock:
            if not self.reason:
                self.reason = reason
            self.dead = True
            for cv in (self._send_cv, self._recv_cv, self._role_cv):
                cv.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _send_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._queue and not self.dead:
                        self._send_cv.wait()
                    if self.dead:
                        return
                with self._send_lock:
                    self._drain()
        except OSError as exc:
            self.abort(f"send failed: {exc}")

    def _drain(self) -> None:
        """Send queued frames as trains until the queue is empty (caller holds the send lock)."""
        while True:
            with self._lock:
                if self.dead or not self._queue:
                    return
                train = self._take_train()
            self._send(train)

    def _take_train(self) -> list[Frame]:
        train: list[Frame] = []
        nbytes = 0
        while self._queue and len(train) < TRAIN_FRAMES and nbytes < TRAIN_BYTES:
            frame = self._queue.popleft()
            frame.req_id = next(self._ids)
            train.append(frame)
            nbytes += frame.length
            if frame.op.op is P.Op.WRITE:
                self._queued_payload -= frame.length
        has_async = not all(f.sync for f in train)
        self._trains.append((train, has_async))
        if has_async:
            self._async_trains += 1
            self._recv_cv.notify()
        self._role_cv.notify_all()  # a driver may be waiting for its train to be sent
        return train

    def _send(self, train: list[Frame]) -> None:
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

    # -- one exchange by the calling thread ---------------------------------------------------

    def claim(self) -> bool:
        """Take the connection for one ``exchange`` if nobody uses it: the send lock and the
        reader role, with nothing queued or unanswered on it."""
        if not self._send_lock.acquire(blocking=False):
            return False
        with self._lock:
            if not (self.dead or self._reading or self._queue or self._trains):
                self._reading = True
                return True
        self._send_lock.release()
        return False

    def exchange(self, op: P.Op, items: list[tuple], deadline: float) -> list:
        """Send one train of ``items`` (``(op, local view, descriptor, remote offset)``, all
        READs or all WRITEs) and receive its replies, in this thread, which holds the
        connection (``claim``) and gives it back; per item None or its error. The socket's
        kernel timeouts (``STALL_CHECK_S``) let every wait look at ``deadline``; a failure
        breaks the connection."""
        n = len(items)
        size, rsize = P.REQUEST.size, P.RESPONSE.size
        heads = bytearray(size * n)
        replies = memoryview(bytearray(rsize * n))
        first = next(self._ids)
        for _ in range(n - 1):
            next(self._ids)
        read = op is P.Op.READ
        out: list = [heads] if read else []
        into: list = [] if read else [replies]
        hview = memoryview(heads)
        for i, (_, local, desc, offset) in enumerate(items):
            flags = P.FLAG_END if i == n - 1 else 0
            P.REQUEST.pack_into(heads, i * size, op, flags, 0, desc.segment_id, first + i,
                                offset, len(local))  # fmt: skip
            if read:
                into += (replies[i * rsize : (i + 1) * rsize], local)
            else:
                out += (hview[i * size : (i + 1) * size], local)
        try:
            P.sendmsg_all(self.sock, out, deadline)
            spin_until_readable(self.sock, self.spin_s)
            P.recvmsg_exact(self.sock, into, deadline)
            return [self._reply_error(replies, i, first + i, op, items[i]) for i in range(n)]
        except (OSError, ConnectionError, P.FrameError) as exc:
            if isinstance(exc, P.FrameError):
                logger.warning("transfer: bad reply from %s: %r", self.peer, exc)
            self.abort(str(exc) or type(exc).__name__)
            if time.monotonic() >= deadline:
                err: Exception = KVPoolTimeoutError(f"transfer to {self.peer} timed out")
            else:
                err = TransferError(f"connection to {self.peer} lost: {self.reason}")
            return [err] * n
        finally:
            self._release_role()
            self._send_lock.release()

    @staticmethod
    def _reply_error(replies: memoryview, i: int, req_id: int, op: P.Op, item: tuple):
        status, rop, _, _, rid, length = P.RESPONSE.unpack_from(replies, i * P.RESPONSE.size)
        want = len(item[1]) if op is P.Op.READ else 0
        if rid != req_id or rop != op or length != want:
            raise P.FrameError(f"unexpected reply (request {rid}, length {length})")
        if status == P.Status.OK:
            return None
        return _status_error(status, op, item[2].name)

    # -- receiving ----------------------------------------------------------------------------

    def drive(self, handle: BatchHandle, finished: Callable[[], bool] | None = None) -> None:
        """Read replies in this thread until ``finished()`` (default: ``handle`` is done),
        whenever the reader role is free; otherwise sleep until whoever holds it has read
        ours."""
        finished = finished or handle.done
        while not finished():
            with self._lock:
                while not self.dead and not finished() and (self._reading or not self._trains):
                    if not self._reading and not self._queue:
                        # nothing left to read here: what is missing travels on another
                        # connection (a striped request), read by its own reader; the caller
                        # waits for the handle (waiting here would wait for a notify that
                        # never comes, until the 50 ms poll)
                        return
                    self._role_cv.wait(0.05)
                if self.dead or finished():
                    return
                self._reading = True
            try:
                self._read_while(lambda: not finished())
            except Exception as exc:  # the receiver thread fails what is left
                self._broken(exc)
                return
            finally:
                self._release_role()

    def _recv_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self.dead and (self._reading or not self._async_trains):
                        self._recv_cv.wait()
                    if self.dead:
                        return
                    self._reading = True
                try:
                    self._read_while(lambda: self._async_trains > 0)
                except Exception as exc:
                    self._broken(exc)
                    return
                finally:
                    self._release_role()
        finally:
            self._fail_all()
            self.sock.close()

    def _release_role(self) -> None:
        with self._lock:
            self._reading = False
            if self._async_trains:
                self._recv_cv.notify()
            self._role_cv.notify_all()

    def _broken(self, exc: Exception) -> None:
        if not isinstance(exc, OSError | ConnectionError):
            logger.warning("transfer: bad reply from %s: %r", self.peer, exc)
        self.abort(str(exc) or type(exc).__name__)

    def _read_while(self, more: Callable[[], bool]) -> None:
        """Receive trains in order while ``more()`` (the caller holds the reader role)."""
        while True:
            with self._lock:
                if self.dead or not self._trains or not more():
                    return
                train, has_async = self._trains[0]  # listed until received (or failed with it)
            self._receive_train(train)
            with self._lock:
                self._trains.popleft()
                if has_async:
                    self._async_trains -= 1

    def _receive_train(self, train: list[Frame]) -> None:
        """Every reply of a train in one scatter read (replies have predictable sizes: a READ
        reply always carries ``length`` bytes), READ payloads straight into their buffers."""
        size = P.RESPONSE.size
        heads = memoryview(bytearray(size * len(train)))
        views: list[memoryview] = []
        for i, frame in enumerate(train):
            views.append(heads[i * size : (i + 1) * size])
            if frame.op.op is P.Op.READ:
                views.append(frame.local)
        P.recvmsg_exact(self.sock, views)
        results = []
        for i, frame in enumerate(train):
            status, op, _, _, req_id, length = P.RESPONSE.unpack_from(heads, i * size)
            want = frame.length if op == P.Op.READ else 0
            if frame.req_id != req_id or op != frame.op.op or length != want:
                raise P.FrameError(f"unexpected reply (request {req_id}, length {length})")
            results.append(None if status == P.Status.OK else
                           _status_error(status, frame.op.op, frame.op.desc.name))  # fmt: skip
        finished = [
            frame.op
            for frame, error in zip(train, results, strict=True)
            if frame.op.resolve(0 if error else frame.length, error)
        ]
        if finished:
            finish_ops(finished)

    def _fail_all(self) -> None:
        """Fail every frame still carried, once no thread reads into or sends from them."""
        with self._lock:
            self.dead = True
            self._role_cv.wait_for(lambda: not self._reading, timeout=10)
            frames = [f for train, _ in self._trains for f in train] + list(self._queue)
            self._trains.clear()
            self._queue.clear()
        self._sender.join(timeout=10)
        if self._send_lock.acquire(timeout=10):
            self._send_lock.release()
        err = TransferError(f"connection to {self.peer} lost: {self.reason}")
        finished = [frame.op for frame in frames if frame.op.resolve(0, err)]
        if finished:
            finish_ops(finished)


def _status_error(status: int, op: P.Op, segment: str) -> Exception:
    text = P.STATUS_TEXT.get(status, f"status {status}")  # type: ignore[call-overload]
    msg = f"peer refused {op.name} of {segment}: {text}"
    if status == P.Status.OUT_OF_BOUNDS:
        return BadRequestError(msg)
    if status == P.Status.UNKNOWN_SEGMENT:
        return NotFoundError(msg)
    return TransferError(msg)


def stall_checks(sock: socket.socket, seconds: float = STALL_CHECK_S) -> None:
    """Make each blocking send and receive on ``sock`` return after ``seconds`` without
    progress (``sendmsg_all`` / ``recvmsg_exact`` then look at their deadline and go on)."""
    sec = int(seconds)
    tv = struct.pack("@ll", sec, int((seconds - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

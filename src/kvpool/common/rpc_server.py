"""The RPC server: one selector thread over plain TCP (the wire format is in ``rpc.py``).

Limits come before work: a new connection may send only its small hello frame, within
``handshake_timeout``, and nothing of it is parsed beyond that frame until its proof of the
cluster token checks out; a request's method is read from its first bytes and the request is
decoded only if its size fits that method's limits (and then with element budgets); a partial
frame that makes no progress for ``idle_timeout`` closes its connection; large partial frames
share one global byte budget; a connection whose replies are not read is not read either.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.common import auth
from kvpool.common.errors import BackpressureError, KVPoolError, PayloadTooLargeError
from kvpool.common.net import is_loopback
from kvpool.common.rpc_admit import Connection, Gate, Refused, ServerLimits, parse_request
from kvpool.common.rpc_dispatch import Call, LatencyHistogram, execute, method_table
from kvpool.common.rpc_wake import WakePipe
from kvpool.common.rpc_wire import (
    HEADER,
    MAGIC,
    MAX_HELLO_BYTES,
    PROTOCOL_VERSION,
    SMALL,
    error_reply,
    frame,
    nodelay,
    pack,
    url_host,
)

logger = logging.getLogger(__name__)

MAX_REPLY = 64 << 20
_POLL_S = 0.1  # how often the loop looks at its stop flag
_SWEEP_S = 0.5  # how often it looks for connections past their deadline
_RECV = 256 << 10  # bytes read per recv
_OUT_PAUSE = 16 << 20  # unsent reply bytes above which a connection is no longer read
_PENDING_PER_CONN = 64  # requests of one connection queued on the worker pool


class RpcServer:
    """Serve a name -> callable dict, or the @rpc_method methods of an object, over TCP.

    ``token``: the cluster token (None: from the environment, ``""``: open, loopback only);
    ``admin_token`` likewise, for ``@rpc_method(admin=True)`` calls. ``workers=1`` runs
    handlers on the serving thread; more runs them on a thread pool (at most ``64 * workers``
    queued, beyond that callers get BackpressureError), so handlers must then be thread-safe.
    """

    def __init__(
        self,
        handler: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        workers: int = 1,
        *,
        admin_token: str | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        token, admin = auth.cluster_token(token), auth.admin_token(admin_token)
        if not is_loopback(host) and not token:
            raise ValueError(f"binding {host!r} (not loopback) requires a non-empty auth token")
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.limits = lim = limits or ServerLimits()
        self._methods = method_table(handler, lim.max_message_size)
        self._gate = Gate.of(token, admin)
        self._workers, self._max_pending, self._pending = workers, 64 * workers, 0
        self._buffer_budget = lim.max_buffered
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server(
            ("127.0.0.1" if host == "localhost" else host, port), family=family, backlog=128
        )
        self._listener.setblocking(False)
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        self.address = f"{url_host(host)}:{self.port}"
        self.stats = dict.fromkeys(("calls", "errors", "malformed", "auth_failures", "dropped"), 0)
        self.latency = LatencyHistogram()  # handler time of successful calls
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._sel = selectors.DefaultSelector()
        self._rbuf = bytearray(_RECV)
        self._rview = memoryview(self._rbuf)
        self._conns: dict[int, Connection] = {}  # by fileno
        self._unauthenticated = 0
        self._done: queue.SimpleQueue[tuple[Connection, bytes]] = queue.SimpleQueue()
        self._wake: WakePipe | None = None
        self._closed = False
        self._next_sweep = 0.0

    def start(self) -> RpcServer:
        """Start serving on a background thread (idempotent)."""
        if self._closed:
            raise RuntimeError("RpcServer is closed")
        if self._thread is None:
            if self._workers > 1:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="kvpool-rpc")
                self._wake = WakePipe()
            self._thread = threading.Thread(
                target=self._serve, name=f"kvpool-rpc-{self.port}", daemon=True
            )
            self._thread.start()
            logger.info("rpc server on %s (%s): %s", self.address,
                        "open" if self._gate.open else "token required", sorted(self._methods))  # fmt: skip
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and release the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is None:
            self._release()
        else:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("rpc server %s did not stop within %.1fs", self.address, timeout)

    def __enter__(self) -> RpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._sel.close()
        self._listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._wake is not None:
            self._wake.close()

    # -- the serving loop ------------------------------------------------------------------

    def _serve(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        wake = self._wake
        wake_fd = wake.read_fd if wake is not None else None
        if wake_fd is not None:
            self._sel.register(wake_fd, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                try:
                    for key, events in self._sel.select(_POLL_S):
                        conn = key.data
                        if conn is None:
                            if wake is not None and key.fd == wake_fd:
                                self._send_done(wake)
                            else:
                                self._accept()
                            continue
                        if events & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if events & selectors.EVENT_READ and conn.sock.fileno() >= 0:
                            self._read(conn)
                    self._sweep()
                except Exception:  # never let one bad turn kill the server
                    logger.exception("rpc server %s: unexpected error", self.address)
                    time.sleep(0.01)
        finally:
            self._release()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: keep serving the others
                logger.warning("rpc %s: accept failed: %s", self.address, exc)
                return
            full = len(self._conns) >= self.limits.max_connections
            if full or self._unauthenticated >= self.limits.max_unauthenticated:
                self.stats["dropped"] += 1
                self._log("connection limit reached, refusing one")
                sock.close()
                continue
            sock.setblocking(False)
            nodelay(sock)
            conn = Connection(
                sock, f"{addr[0]}:{addr[1]}", time.monotonic() + self.limits.handshake_timeout
            )
            self._conns[sock.fileno()] = conn
            self._unauthenticated += 1
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._send(conn, pack([PROTOCOL_VERSION, MAGIC, conn.nonce, not self._gate.open]))

    def _drop(self, conn: Connection) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        self._conns.pop(fd, None)
        if not conn.ready:
            self._unauthenticated -= 1
        self._buffer_budget += conn.reserved
        conn.reserved = 0
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        conn.sock.close()

    def _sweep(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_S
        for conn in [
            c for c in self._conns.values() if c.deadline is not None and c.deadline < now
        ]:
            self.stats["dropped"] += 1
            self._log(f"closing {conn.peer}: {'no handshake' if not conn.ready else 'idle frame'}")
            self._drop(conn)

    def _read(self, conn: Connection) -> None:
        try:
            n = conn.sock.recv_into(self._rbuf)  # a reused buffer: no allocation per read
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:
            self._drop(conn)
            return
        buf = conn.inbuf
        buf += self._rview[:n]
        start, end = 0, len(buf)
        while end - start >= 4 and not conn.closing:
            (size,) = HEADER.unpack_from(buf, start)
            if not self._admit_size(conn, size):
                return
            if end - start - 4 < size:
                break
            if size <= SMALL.max_bytes:  # a copy costs less than a view here
                self._handle(conn, bytes(buf[start + 4 : start + 4 + size]))
            else:
                with memoryview(buf) as view:  # decoded in place: no copy of a large payload
                    payload = view[start + 4 : start + 4 + size]
                    try:
                        self._handle(conn, payload)
                    finally:
                        payload.release()
            start += 4 + size
            self._buffer_budget += conn.reserved
            conn.reserved = 0
            if conn.sock.fileno() < 0:
                return
        if start:
            del buf[:start]
        if conn.ready:
            conn.deadline = time.monotonic() + self.limits.idle_timeout if buf else None

    def _admit_size(self, conn: Connection, size: int) -> bool:
        """Whether a frame of ``size`` bytes may be received (else: error reply, closing)."""
        limit = self.limits.max_message_size if conn.ready else MAX_HELLO_BYTES
        error: KVPoolError | None = None
        if size > limit:
            error = PayloadTooLargeError(f"message of {size} bytes exceeds the limit of {limit}")
        elif size > SMALL.max_bytes and not conn.reserved:
            if size > self._buffer_budget:
                error = BackpressureError("rpc server busy: too many large messages in flight")
            else:
                self._buffer_budget -= size
                conn.reserved = size
        if error is None:
            return True
        self._refuse(conn, error)  # the stream cannot be trusted after this
        return False

    # -- the handshake, then requests ---------------------------------------------------------

    def _handle(self, conn: Connection, payload: bytes | memoryview) -> None:
        if conn.ready:
            self._dispatch(conn, payload)
        else:
            self._hello(conn, payload)

    def _hello(self, conn: Connection, payload: bytes | memoryview) -> None:
        try:
            admitted = self._gate.hello(payload, conn.nonce)
        except Refused as refused:
            self.stats["auth_failures"] += refused.auth
            self._refuse(conn, refused.error)
            return
        conn.ready, conn.deadline = True, None
        self._unauthenticated -= 1
        conn.ctx = admitted.context(conn.peer)
        self._send(conn, admitted.welcome)

    def _dispatch(self, conn: Connection, payload: bytes | memoryview) -> None:
        try:
            call = parse_request(payload, self._methods, conn.ctx)
        except Refused as refused:
            self._reject(conn, refused.request_id, refused.error)
            return
        self.stats["calls"] += 1
        if self._pool is None:
            self._send(conn, execute(call, MAX_REPLY, self.latency, self.stats))
        elif self._pending >= self._max_pending or conn.pending >= _PENDING_PER_CONN:
            self._reject(conn, call.request_id, BackpressureError("rpc server busy"))
        else:
            self._pending += 1
            conn.pending += 1
            self._pool.submit(self._work, conn, call)

    def _work(self, conn: Connection, call: Call) -> None:
        self._done.put((conn, execute(call, MAX_REPLY, self.latency, self.stats)))
        if self._wake is not None:
            self._wake.signal()

    def _send_done(self, wake: WakePipe) -> None:
        wake.drain()
        for _ in range(self._max_pending + 1):
            try:
                conn, data = self._done.get_nowait()
            except queue.Empty:
                return
            self._pending -= 1
            conn.pending -= 1
            if conn.sock.fileno() >= 0:
                self._send(conn, data)

    def _log(self, what: str) -> None:
        n = self.stats["malformed"] + self.stats["dropped"] + self.stats["auth_failures"]
        level = logging.WARNING if n <= 10 or n % 1000 == 0 else logging.DEBUG  # no log floods
        logger.log(level, "rpc %s: %s", self.address, what)

    def _reject(self, conn: Connection, request_id: int | None, error: KVPoolError) -> None:
        self.stats["malformed"] += 1
        self._log(f"rejected a request from {conn.peer}: {error.message}")
        self._send(conn, error_reply(request_id, error))

    def _refuse(self, conn: Connection, error: KVPoolError) -> None:
        """An error reply, then the connection closes (once the reply is out)."""
        self._reject(conn, None, error)
        conn.closing = True
        self._flush(conn)

    # -- output ----------------------------------------------------------------------------

    def _send(self, conn: Connection, data: bytes) -> None:
        if conn.outbuf:
            conn.outbuf += frame(data)
            if len(conn.outbuf) > _OUT_PAUSE:  # it does not read its replies: stop reading it
                self._want(conn, selectors.EVENT_WRITE)
            return
        out = frame(data)
        try:
            sent = conn.sock.send(out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:  # peer gone: its replies go nowhere
            logger.debug("rpc %s: reply dropped: %s", self.address, exc)
            self._drop(conn)
            return
        if sent < len(out):
            conn.outbuf += memoryview(out)[sent:]
            self._want(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _flush(self, conn: Connection) -> None:
        while conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    logger.debug("rpc %s: send failed: %s", self.address, exc)
                self._drop(conn)
                return
            del conn.outbuf[:sent]
            if not conn.closing and conn.mask == selectors.EVENT_WRITE and \
                    len(conn.outbuf) <= _OUT_PAUSE // 2:  # fmt: skip
                self._want(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
        if conn.closing:
            self._drop(conn)
        else:
            self._want(conn, selectors.EVENT_READ)

    def _want(self, conn: Connection, mask: int) -> None:
        if conn.mask != mask and conn.sock.fileno() >= 0:
            conn.mask = mask
            self._sel.modify(conn.sock, mask, conn)

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
import os
import queue
import selectors
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.common import auth
from kvpool.common.errors import (
    AuthError,
    BackpressureError,
    BadRequestError,
    KVPoolError,
    PayloadTooLargeError,
    ProtocolError,
)
from kvpool.common.net import is_loopback
from kvpool.common.rpc_dispatch import (
    Call,
    CallContext,
    LatencyHistogram,
    execute,
    method_table,
)
from kvpool.common.rpc_wire import (
    BULK,
    HEADER,
    HELLO,
    MAGIC,
    MAX_HELLO_BYTES,
    PROTOCOL_VERSION,
    ROLES,
    SMALL,
    error_reply,
    frame,
    is_int,
    nodelay,
    pack,
    unpack,
    url_host,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_SIZE = BULK.max_bytes  # largest request; replies may be up to MAX_REPLY
MAX_REPLY = 64 << 20
_POLL_S = 0.1  # how often the loop looks at its stop flag
_SWEEP_S = 0.5  # how often it looks for connections past their deadline
_RECV = 256 << 10  # bytes read per recv
_OUT_PAUSE = 16 << 20  # unsent reply bytes above which a connection is no longer read
_PENDING_PER_CONN = 64  # requests of one connection queued on the worker pool


class _Conn:
    """One client connection: its socket, unparsed input, unsent output and identity."""

    __slots__ = ("client_id", "closing", "deadline", "inbuf", "mask", "nonce", "outbuf",
                 "peer", "pending", "ready", "reserved", "role", "sock")  # fmt: skip

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.closing = False  # close once the output is flushed
        self.mask = selectors.EVENT_READ
        self.ready = False  # handshake done
        self.nonce = auth.new_nonce()
        self.deadline: float | None = deadline  # handshake, or a partial frame's idle limit
        self.role = ""
        self.client_id = ""
        self.pending = 0  # its requests on the worker pool
        self.reserved = 0  # bytes of the global buffer budget its partial frame holds


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
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        *,
        admin_token: str | None = None,
        handshake_timeout: float = 5.0,
        idle_timeout: float = 10.0,
        max_connections: int = 1024,
        max_unauthenticated: int = 128,
        max_buffered: int = 256 << 20,
    ) -> None:
        token, admin = auth.cluster_token(token), auth.admin_token(admin_token)
        if not is_loopback(host) and not token:
            raise ValueError(f"binding {host!r} (not loopback) requires a non-empty auth token")
        if workers < 1 or max_message_size < SMALL.max_bytes:
            raise ValueError(f"workers must be >= 1 and max_message_size >= {SMALL.max_bytes}")
        self._methods = method_table(handler, max_message_size)
        self._keys = {r: auth.derive_key(t, auth.RPC)
                      for r, t in (("member", token), ("admin", admin)) if t}  # fmt: skip
        self._open = token is None  # no cluster token: nobody authenticates
        self._workers, self._max_pending, self._pending = workers, 64 * workers, 0
        self._max_size = max_message_size
        self._timeouts = (handshake_timeout, idle_timeout)
        self._caps = (max_connections, max_unauthenticated)
        self._buffer_budget = max_buffered
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
        self._conns: dict[int, _Conn] = {}  # by fileno
        self._unauthenticated = 0
        self._done: queue.SimpleQueue[tuple[_Conn, bytes]] = queue.SimpleQueue()
        self._wake_lock = threading.Lock()
        self._wake: tuple[int, int] | None = None
        self._closed = False
        self._next_sweep = 0.0

    def start(self) -> RpcServer:
        """Start serving on a background thread (idempotent)."""
        if self._closed:
            raise RuntimeError("RpcServer is closed")
        if self._thread is None:
            if self._workers > 1:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="kvpool-rpc")
                self._wake = os.pipe()
                os.set_blocking(self._wake[0], False)
                os.set_blocking(self._wake[1], False)
            self._thread = threading.Thread(
                target=self._serve, name=f"kvpool-rpc-{self.port}", daemon=True
            )
            self._thread.start()
            logger.info("rpc server on %s (%s): %s", self.address,
                        "open" if self._open else "token required", sorted(self._methods))  # fmt: skip
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

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _release(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._sel.close()
        self._listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._wake_lock:
            if self._wake is not None:
                os.close(self._wake[0])
                os.close(self._wake[1])
                self._wake = None

    # -- the serving loop ------------------------------------------------------------------

    def _serve(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        wake_fd = self._wake[0] if self._wake else None
        if wake_fd is not None:
            self._sel.register(wake_fd, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                try:
                    for key, events in self._sel.select(_POLL_S):
                        conn = key.data
                        if conn is None:
                            if key.fd == wake_fd:
                                self._send_done(wake_fd)
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
            if len(self._conns) >= self._caps[0] or self._unauthenticated >= self._caps[1]:
                self.stats["dropped"] += 1
                self._log("connection limit reached, refusing one")
                sock.close()
                continue
            sock.setblocking(False)
            nodelay(sock)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", time.monotonic() + self._timeouts[0])
            self._conns[sock.fileno()] = conn
            self._unauthenticated += 1
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._send(conn, pack([PROTOCOL_VERSION, MAGIC, conn.nonce, not self._open]))

    def _drop(self, conn: _Conn) -> None:
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

    def _read(self, conn: _Conn) -> None:
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
            with memoryview(buf) as view:  # decoded in place: no copy of the payload
                payload = view[start + 4 : start + 4 + size]
                try:
                    self._dispatch(conn, payload) if conn.ready else self._hello(conn, payload)
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
            conn.deadline = time.monotonic() + self._timeouts[1] if buf else None

    def _admit_size(self, conn: _Conn, size: int) -> bool:
        """Whether a frame of ``size`` bytes may be received (else: error reply, closing)."""
        limit = self._max_size if conn.ready else MAX_HELLO_BYTES
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
        self._reject(conn, None, error)
        conn.closing = True  # the stream cannot be trusted after this
        self._flush(conn)
        return False

    # -- the handshake ---------------------------------------------------------------------

    def _hello(self, conn: _Conn, payload: memoryview) -> None:
        """The client's ``[version, nonce, role, proof, client_id]``: admit or refuse it."""
        try:
            msg = unpack(payload, HELLO)
        except Exception:
            msg = None
        if not (isinstance(msg, list) and len(msg) == 5 and is_int(msg[0])):
            return self._refuse(conn, ProtocolError("expected a hello [version, nonce, role, "
                                                    "proof, client_id] first"))  # fmt: skip
        version, nonce, role, given, client_id = msg
        if version != PROTOCOL_VERSION:
            return self._refuse(conn, ProtocolError(f"unsupported protocol version {version}"))
        if not (isinstance(nonce, bytes) and len(nonce) == auth.NONCE_BYTES and role in ROLES
                and isinstance(client_id, str) and 0 < len(client_id) <= 64):  # fmt: skip
            return self._refuse(conn, ProtocolError("malformed hello"))
        key = self._keys.get(role)
        if key is not None:
            if not auth.proofs_match(given, auth.proof(key, b"client", conn.nonce, nonce)):
                self.stats["auth_failures"] += 1
                return self._refuse(conn, AuthError("missing or wrong auth token"))
            reply_proof = auth.proof(key, b"server", nonce, conn.nonce)
        elif self._open and (role == "member" or "admin" not in self._keys):
            reply_proof = None  # open mode: no authentication (loopback only)
        else:
            self.stats["auth_failures"] += 1
            what = "admin calls are disabled (no admin token)" if role == "admin" and \
                not self._open else "missing or wrong auth token"  # fmt: skip
            return self._refuse(conn, AuthError(what))
        conn.ready, conn.deadline = True, None
        self._unauthenticated -= 1
        # open mode without an admin token: no authorization either, every caller may do all
        conn.role = "admin" if role == "admin" or (self._open and "admin" not in self._keys) \
            else "member"  # fmt: skip
        conn.client_id = client_id
        self._send(conn, pack([True, reply_proof, conn.role]))

    def _refuse(self, conn: _Conn, error: KVPoolError) -> None:
        self._reject(conn, None, error)
        conn.closing = True
        self._flush(conn)

    # -- requests --------------------------------------------------------------------------

    def _dispatch(self, conn: _Conn, payload: memoryview) -> None:
        call = self._parse(conn, payload)
        if call is None:
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

    def _parse(self, conn: _Conn, payload: memoryview) -> Call | None:
        """The call in ``payload`` (None: refused with an error reply)."""
        head = _peek(payload)
        if head is None:
            self._reject(conn, None, ProtocolError("request must be [method, id, args, kwargs]"))
            return None
        name, rid = head
        method = self._methods.get(name)
        if method is None:
            self._reject(conn, rid, BadRequestError(f"unknown method {name!r}"))
            return None
        if len(payload) > method.limits.max_bytes:
            self._reject(conn, rid, PayloadTooLargeError(
                f"request to {name} of {len(payload)} bytes exceeds its limit of "
                f"{method.limits.max_bytes}"))  # fmt: skip
            return None
        try:
            msg = unpack(payload, method.limits)
        except Exception as exc:
            self._reject(conn, rid, ProtocolError(f"request to {name} not decoded: {exc}"[:200]))
            return None
        if not (isinstance(msg, list) and len(msg) == 4 and isinstance(msg[2], list)
                and isinstance(msg[3], dict) and all(isinstance(k, str) for k in msg[3])):  # fmt: skip
            self._reject(conn, rid, ProtocolError("args must be an array and kwargs a map"))
            return None
        return Call(rid, method, msg[2], msg[3], CallContext(conn.client_id, conn.role, conn.peer))

    def _work(self, conn: _Conn, call: Call) -> None:
        self._done.put((conn, execute(call, MAX_REPLY, self.latency, self.stats)))
        with self._wake_lock:
            if self._wake is not None:
                with contextlib.suppress(BlockingIOError):  # full pipe: the loop is awake
                    os.write(self._wake[1], b"\0")

    def _send_done(self, wake_fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(wake_fd, 4096)
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

    def _reject(self, conn: _Conn, request_id: int | None, error: KVPoolError) -> None:
        self.stats["malformed"] += 1
        self._log(f"rejected a request from {conn.peer}: {error.message}")
        self._send(conn, error_reply(request_id, error))

    # -- output ----------------------------------------------------------------------------

    def _send(self, conn: _Conn, data: bytes) -> None:
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

    def _flush(self, conn: _Conn) -> None:
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

    def _want(self, conn: _Conn, mask: int) -> None:
        if conn.mask != mask and conn.sock.fileno() >= 0:
            conn.mask = mask
            self._sel.modify(conn.sock, mask, conn)


def _peek(payload: memoryview) -> tuple[str, int] | None:
    """``(method, request id)`` from the first bytes of ``[method, id, args, kwargs]``: a
    fixarray of 4, a fixstr, then a non-negative integer (nothing else is decoded)."""
    if len(payload) < 3 or payload[0] != 0x94 or not 0xA0 <= payload[1] <= 0xBF:
        return None
    n = payload[1] & 0x1F
    i = 2 + n
    if len(payload) <= i:
        return None
    try:
        name = bytes(payload[2:i]).decode("ascii")
    except UnicodeDecodeError:
        return None
    tag = payload[i]
    if tag <= 0x7F:
        return name, tag
    width = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}.get(tag)
    if width is None or len(payload) < i + 1 + width:
        return None
    return name, int.from_bytes(payload[i + 1 : i + 1 + width], "big")


def new_client_id() -> str:
    return uuid.uuid4().hex

"""The RPC server (one selector thread over plain TCP) and the helpers both sides share.

The wire format is described once, in ``kvpool.common.rpc`` (the module callers import).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import hmac
import inspect
import logging
import os
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from kvpool.common.errors import (
    BackpressureError,
    BadRequestError,
    KVPoolError,
    ProtocolError,
)
from kvpool.common.net import is_loopback
from kvpool.common.rpc_wire import (
    AuthError,
    _is_int,
    error_body,
    pack,
    unpack,
)

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_SIZE = 64 << 20
HEADER = struct.Struct(">I")  # the length of the msgpack payload that follows
_POLL_S = 0.1  # how often the server loop looks at its stop flag
_RECV = 256 << 10  # bytes read per recv
_MAX_CONNECTIONS = 1024
_MAX_STALE = 10_000  # stale replies a client discards per call before giving up
MARK = "__kvpool_rpc__"


def rpc_method(fn: Callable) -> Callable:
    """Expose a method of a handler object to RPC callers (nothing else is exposed)."""
    setattr(fn, MARK, True)
    return fn


def frame(payload: bytes) -> bytes:
    """``payload`` with its length header (one buffer: one send)."""
    return HEADER.pack(len(payload)) + payload


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _url_host(host: str) -> str:
    host = "127.0.0.1" if host == "localhost" else host
    return f"[{host}]" if ":" in host else host


def _nodelay(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Bad(Exception):
    """A request that gets an error reply instead of a call."""

    def __init__(self, request_id: int | None, error: KVPoolError) -> None:
        super().__init__(error.message)
        self.request_id = request_id
        self.error = error


class _Request(NamedTuple):
    request_id: int
    method: str
    fn: Callable
    args: list
    kwargs: dict


class _Conn:
    """One client connection: its socket, unparsed input and unsent output."""

    __slots__ = ("closing", "inbuf", "mask", "outbuf", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.closing = False  # close once the output is flushed
        self.mask = selectors.EVENT_READ


def _method_table(handler: Any) -> dict[str, Callable]:
    if isinstance(handler, Mapping):
        table = dict(handler)
        bad = [n for n, fn in table.items() if not isinstance(n, str) or not callable(fn)]
        if bad:
            raise TypeError(f"RPC handler dict needs str -> callable, bad entries: {bad!r}")
    else:
        table = {}
        for name in dir(type(handler)):
            raw = inspect.getattr_static(type(handler), name, None)  # no property side effects
            if not name.startswith("_") and getattr(getattr(raw, "__func__", raw), MARK, False):
                table[name] = getattr(handler, name)
        if not table:
            raise ValueError(f"{type(handler).__name__} has no @rpc_method methods")
    for name, fn in table.items():
        if inspect.iscoroutinefunction(fn):
            raise TypeError(f"RPC method {name!r} must be synchronous")
    return table


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # fmt: skip


class LatencyHistogram:
    """Cumulative bucket counts (Prometheus style), cheap enough for every call."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            self.counts[i] += 1
            self.total += seconds

    def buckets(self) -> tuple[list[tuple[str, int]], float]:
        """``([(le, cumulative count), ..., ("+Inf", n)], sum)``."""
        with self._lock:
            counts, total = list(self.counts), self.total
        out, running = [], 0
        for bound, n in zip((*LATENCY_BUCKETS, None), counts, strict=True):
            running += n
            out.append(("+Inf" if bound is None else repr(bound), running))
        return out, total


class RpcServer:
    """Serve a name -> callable dict, or the @rpc_method methods of an object, over TCP.

    One thread multiplexes every connection (epoll). ``workers=1`` runs handlers on that
    thread; more runs them on a thread pool (at most ``64 * workers`` queued, beyond that
    callers get BackpressureError), so handlers must then be thread-safe.
    """

    def __init__(
        self,
        handler: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        workers: int = 1,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(f"binding {host!r} (not loopback) requires a non-empty auth token")
        if workers < 1 or max_message_size < 1:
            raise ValueError("workers and max_message_size must be >= 1")
        self._methods = _method_table(handler)
        self._sigs = {name: _signature(fn) for name, fn in self._methods.items()}
        self._token = token.encode() if token else None
        self._workers, self._max_pending, self._pending = workers, 64 * workers, 0
        self._max_size = max_message_size
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server(
            ("127.0.0.1" if host == "localhost" else host, port), family=family, backlog=128
        )
        self._listener.setblocking(False)
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        self.address = f"{_url_host(host)}:{self.port}"
        self.stats = {"calls": 0, "errors": 0, "malformed": 0}
        self.latency = LatencyHistogram()  # handler time of successful calls
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._sel = selectors.DefaultSelector()
        self._rbuf = bytearray(_RECV)
        self._rview = memoryview(self._rbuf)
        self._conns: dict[int, _Conn] = {}  # by fileno
        self._done: queue.SimpleQueue[tuple[_Conn, bytes]] = queue.SimpleQueue()
        self._wake_lock = threading.Lock()
        self._wake: tuple[int, int] | None = None
        self._closed = False

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
            logger.info("rpc server on %s: %s", self.address, sorted(self._methods))
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
                except Exception:  # never let one bad turn kill the server
                    logger.exception("rpc server %s: unexpected error", self.address)
                    time.sleep(0.01)
        finally:
            self._release()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: keep serving the others
                logger.warning("rpc %s: accept failed: %s", self.address, exc)
                return
            if len(self._conns) >= _MAX_CONNECTIONS:
                logger.warning("rpc %s: connection limit reached, refusing one", self.address)
                sock.close()
                continue
            sock.setblocking(False)
            _nodelay(sock)
            conn = _Conn(sock)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        self._conns.pop(fd, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        if conn.closing or len(conn.outbuf) > self._max_size:
            return  # a client that does not read its replies is not read either
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
        while end - start >= 4:
            (size,) = HEADER.unpack_from(buf, start)
            if size > self._max_size:
                self._reject(
                    conn,
                    None,
                    ProtocolError(f"message of {size} bytes exceeds the limit of {self._max_size}"),
                )
                conn.closing = True  # the stream cannot be trusted after this
                self._flush(conn)
                return
            if end - start - 4 < size:
                break
            payload = bytes(buf[start + 4 : start + 4 + size])
            start += 4 + size
            self._dispatch(conn, payload)
            if conn.sock.fileno() < 0:
                return
        if start:
            del buf[:start]

    def _dispatch(self, conn: _Conn, payload: bytes) -> None:
        try:
            req = self._parse(payload)
        except _Bad as bad:
            self._reject(conn, bad.request_id, bad.error)
            return
        self.stats["calls"] += 1
        if self._pool is None:
            self._send(conn, self._execute(req))
        elif self._pending >= self._max_pending:
            self._reject(conn, req.request_id, BackpressureError("rpc server busy"))
        else:
            self._pending += 1
            self._pool.submit(self._work, conn, req)

    def _parse(self, payload: bytes) -> _Request:
        try:
            msg = unpack(payload)
        except Exception as exc:
            raise _Bad(None, ProtocolError(f"request is not msgpack: {exc}"[:200])) from None
        rid = msg[1] if isinstance(msg, list) and len(msg) > 1 and _is_int(msg[1]) else None
        if not isinstance(msg, list) or len(msg) != 6 or rid is None:
            raise _Bad(
                rid, ProtocolError("request must be [version, id, method, args, kwargs, token]")
            )
        version, _, method, args, kwargs, token = msg
        if not _is_int(version) or version != PROTOCOL_VERSION:
            raise _Bad(rid, ProtocolError(f"unsupported protocol version {version!r}"[:100]))
        if self._token is not None and not (
            isinstance(token, str) and hmac.compare_digest(token.encode(), self._token)
        ):
            raise _Bad(rid, AuthError("missing or wrong auth token"))
        if not isinstance(method, str) or method not in self._methods:
            raise _Bad(rid, BadRequestError(f"unknown method {method!r}"[:200]))
        if not isinstance(args, list) or not (
            isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)
        ):
            raise _Bad(rid, ProtocolError("args must be an array and kwargs a map"))
        return _Request(rid, method, self._methods[method], args, kwargs)

    def _execute(self, req: _Request) -> bytes:
        t0 = time.perf_counter()
        try:
            data = pack([req.request_id, True, req.fn(*req.args, **req.kwargs)])
            self.latency.observe(time.perf_counter() - t0)
            if len(data) <= self._max_size:
                return data
            error: KVPoolError = KVPoolError(f"result of {req.method} exceeds the message limit")
        except KVPoolError as exc:
            error = exc
        except TypeError as exc:
            error = self._argument_error(req, exc)
        except Exception:
            logger.exception("rpc: internal error in %s", req.method)
            error = KVPoolError(f"internal error in {req.method}")
        self.stats["errors"] += 1
        return pack([req.request_id, False, error_body(error)])

    def _argument_error(self, req: _Request, exc: TypeError) -> KVPoolError:
        """A TypeError is the caller's fault when the arguments do not fit the signature
        (checked only now, off the fast path); otherwise it is an internal error."""
        sig = self._sigs[req.method]
        try:
            if sig is not None:
                sig.bind(*req.args, **req.kwargs)
        except TypeError as bad:
            return BadRequestError(f"bad arguments for {req.method}: {bad}"[:300])
        logger.error("rpc: internal error in %s: %s", req.method, exc, exc_info=exc)
        return KVPoolError(f"internal error in {req.method}")

    def _work(self, conn: _Conn, req: _Request) -> None:
        self._done.put((conn, self._execute(req)))
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
            if conn.sock.fileno() >= 0:
                self._send(conn, data)

    def _reject(self, conn: _Conn, request_id: int | None, error: KVPoolError) -> None:
        self.stats["malformed"] += 1
        n = self.stats["malformed"]
        level = logging.WARNING if n <= 10 or n % 1000 == 0 else logging.DEBUG  # no log floods
        logger.log(level, "rpc %s: rejected request #%d: %s", self.address, n, error.message)
        self._send(conn, pack([request_id, False, error_body(error)]))

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.outbuf:
            conn.outbuf += frame(data)
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
        if conn.closing:
            self._drop(conn)
        else:
            self._want(conn, selectors.EVENT_READ)

    def _want(self, conn: _Conn, mask: int) -> None:
        if conn.mask != mask and conn.sock.fileno() >= 0:
            conn.mask = mask
            self._sel.modify(conn.sock, mask, conn)

"""The RPC server (ROUTER socket) and the helpers both sides share.

The wire format is described once, in ``kvpool.common.rpc`` (the module callers import).
"""

from __future__ import annotations

import bisect
import contextlib
import hmac
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import zmq

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
_POLL_MS = 100  # how often the server loop looks at its stop flag
_BATCH = 256  # messages read per loop turn
_MAX_STALE = 10_000  # stale replies a client discards per call before giving up
MARK = "__kvpool_rpc__"


def rpc_method(fn: Callable) -> Callable:
    """Expose a method of a handler object to RPC callers (nothing else is exposed)."""
    setattr(fn, MARK, True)
    return fn


def _new_socket(kind: int, max_message_size: int, ipv6: bool) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _url_host(host: str) -> str:
    host = "127.0.0.1" if host == "localhost" else host
    return f"[{host}]" if ":" in host else host


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
    """Serve a name -> callable dict, or the @rpc_method methods of an object, on a ROUTER.

    ``workers=1`` runs handlers on the serving thread; more runs them on a thread pool (at
    most ``64 * workers`` queued, beyond that callers get BackpressureError), so handlers
    must then be thread-safe.
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
        self._sock = _new_socket(zmq.ROUTER, max_message_size, ":" in host)
        try:
            self._sock.bind(f"tcp://{_url_host(host)}:{port or '*'}")
        except zmq.ZMQError:
            self._sock.close(linger=0)
            raise
        self.host = host
        self.port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.address = f"{_url_host(host)}:{self.port}"
        self.stats = {"calls": 0, "errors": 0, "malformed": 0}
        self.latency = LatencyHistogram()  # handler time of successful calls
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._done: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
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
        """Stop serving and release the socket (idempotent)."""
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
        self._sock.close(linger=0)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._wake_lock:
            if self._wake is not None:
                os.close(self._wake[0])
                os.close(self._wake[1])
                self._wake = None

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        wake_fd = self._wake[0] if self._wake else None
        if wake_fd is not None:
            poller.register(wake_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(_POLL_MS))
                    if self._sock in events:
                        self._read_requests()
                    if wake_fd is not None and wake_fd in events:
                        self._send_done(wake_fd)
                except zmq.ContextTerminated:
                    return
                except Exception:  # never let one bad turn kill the server
                    logger.exception("rpc server %s: unexpected error", self.address)
                    time.sleep(0.01)
        finally:
            self._release()

    def _read_requests(self) -> None:
        for _ in range(_BATCH):
            if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # cheaper than zmq.Again
                return
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 2:
                self._reject(
                    frames[0], None, ProtocolError(f"expected 1 frame, got {len(frames) - 1}")
                )
                continue
            try:
                req = self._parse(frames[1])
            except _Bad as bad:
                self._reject(frames[0], bad.request_id, bad.error)
                continue
            self.stats["calls"] += 1
            if self._pool is None:
                self._send(frames[0], self._execute(req))
            elif self._pending >= self._max_pending:
                self._reject(frames[0], req.request_id, BackpressureError("rpc server busy"))
            else:
                self._pending += 1
                self._pool.submit(self._work, frames[0], req)

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
        sig = self._sigs[method]
        try:
            if sig is not None:
                sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise _Bad(rid, BadRequestError(f"bad arguments for {method}: {exc}"[:300])) from None
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
        except Exception:
            logger.exception("rpc: internal error in %s", req.method)
            error = KVPoolError(f"internal error in {req.method}")
        self.stats["errors"] += 1
        return pack([req.request_id, False, error_body(error)])

    def _work(self, identity: bytes, req: _Request) -> None:
        self._done.put((identity, self._execute(req)))
        with self._wake_lock:
            if self._wake is not None:
                with contextlib.suppress(BlockingIOError):  # full pipe: the loop is awake
                    os.write(self._wake[1], b"\0")

    def _send_done(self, wake_fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(wake_fd, 4096)
        for _ in range(self._max_pending + 1):
            try:
                identity, data = self._done.get_nowait()
            except queue.Empty:
                return
            self._pending -= 1
            self._send(identity, data)

    def _reject(self, identity: bytes, request_id: int | None, error: KVPoolError) -> None:
        self.stats["malformed"] += 1
        n = self.stats["malformed"]
        level = logging.WARNING if n <= 10 or n % 1000 == 0 else logging.DEBUG  # no log floods
        logger.log(level, "rpc %s: rejected request #%d: %s", self.address, n, error.message)
        self._send(identity, pack([request_id, False, error_body(error)]))

    def _send(self, identity: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([identity, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or not reading: ROUTER drops, we log
            logger.warning("rpc %s: reply dropped: %s", self.address, exc)

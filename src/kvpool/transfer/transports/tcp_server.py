"""The TCP side every transfer engine runs: serves READ/WRITE frames against its segments.

One thread per connection, blocking sockets (the GIL is released in every syscall). WRITE
payloads are received straight into the segment (``recv_into`` a memoryview of it); READ
payloads are sent straight from it (``sendmsg`` of memoryview slices): no intermediate copies.
Every frame is bounds-checked against the registered segment; an out-of-bounds or unknown
segment request gets an error response, a malformed frame closes that connection only.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from kvpool.common import auth
from kvpool.transfer import protocol as P
from kvpool.transfer.segment import Segment
from kvpool.transfer.stats import TransferStats

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 512  # each has a thread
MAX_HANDSHAKING = 64  # of those, still proving the token
FLUSH_FRAMES = 256
FLUSH_BYTES = 8 << 20
DRAIN_CHUNK = 1 << 20
HEADER_BUFFER = 4096  # up to 128 headers per recv; at most this much payload is staged


class TransferServer:
    """Accepts peers on ``host:port`` and serves frames for ``lookup(segment_id)``."""

    def __init__(
        self,
        lookup: Callable[[int], Segment | None],
        host: str,
        port: int,
        token: str | None,
        stats: TransferStats,
    ) -> None:
        self._lookup = lookup
        self._key = auth.derive_key(token, auth.TRANSFER) if token else None
        self._stats = stats
        self._sock = socket.create_server((host, port), backlog=128)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._handshaking = 0
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"kvpool-transfer-server-{self.port}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn)
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS or self._handshaking >= MAX_HANDSHAKING
                if not full:
                    self._conns.add(conn)
                    self._handshaking += 1
            if full:
                self._stats.error("connections")
                logger.warning("transfer server: connection limit reached; refusing %s", addr)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve, args=(conn, addr), name="kvpool-transfer-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        try:
            try:
                ok = self._handshake(conn, addr)
            finally:
                with self._lock:
                    self._handshaking -= 1
            if ok:
                self._frames(conn)
        except P.FrameError as exc:
            self._stats.error("protocol")
            logger.warning("transfer server: malformed frame from %s: %s; closing", addr, exc)
        except (ConnectionError, TimeoutError, OSError) as exc:
            if not self._closed:
                logger.debug("transfer server: connection from %s ended: %s", addr, exc)
        except Exception:  # a bug must not take the server down: log it, drop this peer
            self._stats.error("server")
            logger.exception("transfer server: unexpected error serving %s", addr)
        finally:
            with self._lock:
                self._conns.discard(conn)
            _shutdown(conn)
            conn.close()

    def _handshake(self, conn: socket.socket, addr) -> bool:
        """The server side of the challenge-response (see ``protocol``)."""
        deadline = time.monotonic() + P.HANDSHAKE_TIMEOUT
        magic, version, _, client_nonce = P.HELLO.unpack(P.recv_before(conn, P.HELLO.size,
                                                                       deadline))  # fmt: skip
        if magic != P.MAGIC:
            raise P.FrameError(f"bad hello (magic {bytes(magic)!r})")
        nonce = auth.new_nonce()
        if version != P.VERSION:
            conn.sendall(P.CHALLENGE.pack(P.MAGIC, P.Status.BAD_VERSION, 0, nonce, P.NO_PROOF))
            return self._refused(addr, P.Status.BAD_VERSION)
        key = self._key
        mine = P.NO_PROOF if key is None else auth.proof(key, b"server", client_nonce, nonce)
        conn.sendall(P.CHALLENGE.pack(P.MAGIC, P.Status.OK, key is not None, nonce, mine))
        (given,) = P.PROOF.unpack(P.recv_before(conn, P.PROOF.size, deadline))
        ok = key is None or auth.proofs_match(given, auth.proof(key, b"client", nonce,
                                                                client_nonce))  # fmt: skip
        status = P.Status.OK if ok else P.Status.BAD_TOKEN
        conn.sendall(P.WELCOME.pack(P.MAGIC, status))
        if not ok:
            return self._refused(addr, status)
        conn.settimeout(None)
        return True

    def _refused(self, addr, status: P.Status) -> bool:
        self._stats.error("auth" if status == P.Status.BAD_TOKEN else "protocol")
        logger.warning("transfer server: refused %s: %s", addr, P.STATUS_TEXT[status])
        return False

    def _frames(self, conn: socket.socket) -> None:
        reader = _Reader(conn)
        out: list = []
        out_bytes = 0
        served = {"read": 0, "write": 0}
        while True:
            op, flags, seg_id, req_id, offset, length = P.parse_request(reader.header())
            seg = self._lookup(seg_id)
            status = P.Status.OK
            if seg is None:
                status = P.Status.UNKNOWN_SEGMENT
            elif offset + length > seg.size:
                status = P.Status.OUT_OF_BOUNDS
            if status != P.Status.OK:
                self._stats.error("bounds" if seg is not None else "unknown_segment")
            if op == P.Op.WRITE:
                if status == P.Status.OK:
                    reader.read_into(seg.view[offset : offset + length])
                    served["write"] += length
                else:
                    reader.skip(length)
                out.append(P.RESPONSE.pack(status, op, 0, 0, req_id, 0))
            else:  # a READ reply always carries `length` bytes: zeros when refused
                out.append(P.RESPONSE.pack(status, op, 0, 0, req_id, length))
                if status == P.Status.OK:
                    out.append(seg.view[offset : offset + length])
                    served["read"] += length
                else:
                    out.extend(_zeros(length))
                out_bytes += length
            if flags & P.FLAG_END or len(out) >= FLUSH_FRAMES or out_bytes >= FLUSH_BYTES:
                self._stats.served_batch(served)  # before replying: a peer may read stats next
                P.sendmsg_all(conn, out)
                out.clear()
                out_bytes = 0


class _Reader:
    """Reads a connection: headers through a small staging buffer (one ``recv`` brings a whole
    train of them), payloads straight into their destination once the buffer is drained."""

    def __init__(self, conn: socket.socket, size: int = HEADER_BUFFER) -> None:
        self.conn = conn
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    def header(self) -> memoryview:
        n = P.REQUEST.size
        if self.end - self.start < n:
            if self.start:  # move the partial header to the front
                left = self.end - self.start
                self.view[:left] = self.view[self.start : self.end]
                self.start, self.end = 0, left
            while self.end < n:
                k = self.conn.recv_into(self.view[self.end :])
                if k == 0:
                    raise ConnectionError("peer closed the connection")
                self.end += k
        head = self.view[self.start : self.start + n]
        self.start += n
        return head

    def read_into(self, dest: memoryview) -> None:
        have = min(self.end - self.start, len(dest))
        if have:
            dest[:have] = self.view[self.start : self.start + have]
            self.start += have
        if have < len(dest):
            P.recv_exact(self.conn, dest[have:])

    def skip(self, length: int) -> None:
        """Consume a rejected WRITE's payload so the stream stays in sync."""
        have = min(self.end - self.start, length)
        self.start += have
        if length > have:
            _drain(self.conn, length - have)


_ZERO = memoryview(bytes(1 << 20))


def _zeros(length: int) -> list[memoryview]:
    """``length`` zero bytes as views of one shared buffer (payload of a refused READ)."""
    full, rest = divmod(length, len(_ZERO))
    return [_ZERO] * full + ([_ZERO[:rest]] if rest else [])


def _drain(conn: socket.socket, length: int) -> None:
    """Consume a rejected WRITE's payload so the stream stays in sync."""
    scratch = memoryview(bytearray(min(length, DRAIN_CHUNK)))
    left = length
    while left:
        n = min(left, len(scratch))
        P.recv_exact(conn, scratch[:n])
        left -= n


def _shutdown(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)

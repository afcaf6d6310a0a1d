"""The transfer engine's TCP wire format (little-endian, fixed headers, validated bounds).

Connection (a challenge-response that never sends the token): the client sends ``HELLO``
(magic, version, its nonce); the server answers ``CHALLENGE`` (magic, status, whether it wants
a proof, its nonce, and its own proof ``HMAC(key, "server|" + client nonce + "|" + server
nonce)``, zeros when it runs without a token); a client holding the token checks that proof
and refuses a server that cannot give it, then sends ``PROOF`` (``HMAC(key, "client|" + server
nonce + "|" + client nonce)``, zeros without a token); the server answers ``WELCOME`` (magic,
status) and closes the connection unless the status is OK. ``key`` is derived from the cluster
token (``auth.TRANSFER``). The whole handshake must finish within ``HANDSHAKE_TIMEOUT``.

Then the client sends request frames, a 32-byte header each, a WRITE's payload right after its
header. Frames are sent in trains; the last frame of a train carries ``FLAG_END``, which tells
the server to flush the responses it has gathered. Every request gets one 24-byte response
header, in order. A READ's response header is always followed by exactly ``length`` payload
bytes (zeros when the status is not OK), so the size of every reply is known in advance and a
client can receive a whole train of replies with one scatter read.
"""

from __future__ import annotations

import socket
import struct
import time
from enum import IntEnum

from kvpool.config import MAX_FRAME_BYTES

MAGIC = b"KVTE"
VERSION = 2
HANDSHAKE_TIMEOUT = 5.0

HELLO = struct.Struct("<4sHH16s")  # magic, version, reserved, client nonce
CHALLENGE = struct.Struct("<4sBB2x16s32s")  # magic, status, proof wanted, nonce, server proof
PROOF = struct.Struct("<32s")  # the client's proof
WELCOME = struct.Struct("<4sB3x")  # magic, status
NO_PROOF = bytes(32)
REQUEST = struct.Struct("<BBHIQQQ")  # op, flags, reserved, segment id, request id, offset, length
RESPONSE = struct.Struct("<BBHIQQ")  # status, op, reserved, detail, request id, length

FLAG_END = 0x01


class Op(IntEnum):
    READ = 1  # remote -> local
    WRITE = 2  # local -> remote


class Status(IntEnum):
    OK = 0
    BAD_TOKEN = 1
    BAD_VERSION = 2
    UNKNOWN_SEGMENT = 3
    OUT_OF_BOUNDS = 4


STATUS_TEXT = {
    Status.OK: "ok",
    Status.BAD_TOKEN: "authentication failed (KVPOOL_AUTH_TOKEN mismatch)",
    Status.BAD_VERSION: "protocol version mismatch",
    Status.UNKNOWN_SEGMENT: "segment not registered at the peer",
    Status.OUT_OF_BOUNDS: "offset + length outside the registered segment",
}


class FrameError(Exception):
    """A malformed frame: the connection that sent it is closed."""


def parse_request(header: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int, int]:
    """``(op, flags, segment_id, request_id, offset, length)``, validated for shape only."""
    op, flags, reserved, seg_id, req_id, offset, length = REQUEST.unpack(header)
    if op not in (Op.READ, Op.WRITE):
        raise FrameError(f"unknown op {op}")
    if flags & ~FLAG_END or reserved:
        raise FrameError(f"bad flags/reserved field {flags:#x}/{reserved:#x}")
    if length == 0 or length > MAX_FRAME_BYTES:
        raise FrameError(f"frame length {length} not in [1, {MAX_FRAME_BYTES}]")
    return op, flags, seg_id, req_id, offset, length


def recv_before(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all of them before ``deadline`` (``time.monotonic()``): a peer that
    trickles its handshake cannot hold a connection longer than that."""
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake took too long")
        sock.settimeout(left)
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        out += chunk
    return bytes(out)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket, straight into its memory; EOF raises ``ConnectionError``."""
    got = 0
    n = len(view)
    while got < n:  # MSG_WAITALL: one syscall (and one GIL round trip) for the whole payload
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def sendmsg_all(sock: socket.socket, buffers: list, deadline: float | None = None) -> None:
    """Send a list of buffers with scatter/gather I/O (no joining copy), handling short writes
    (``deadline``: ``time.monotonic()`` after which a short write is a ``TimeoutError``; a
    socket with a kernel send timeout is simply tried again until then)."""
    bufs = [b if isinstance(b, bytes) else _flat(b) for b in buffers]
    i, tries = 0, 0
    while i < len(bufs):
        if tries and deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("send past its deadline")
        tries += 1
        try:
            sent = sock.sendmsg(bufs[i : i + 512])
        except BlockingIOError:  # the socket's kernel timeout (a stall check) expired
            continue
        while sent:
            head = len(bufs[i])
            if sent >= head:
                sent -= head
                i += 1
            else:
                bufs[i] = memoryview(bufs[i])[sent:]
                sent = 0
        while i < len(bufs) and len(bufs[i]) == 0:
            i += 1


def _flat(buf) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def recvmsg_exact(sock: socket.socket, views: list[memoryview],
                  deadline: float | None = None) -> None:  # fmt: skip
    """Fill every view, in order, with scatter reads (``MSG_WAITALL``): typically one syscall
    for a whole train of replies; EOF raises ``ConnectionError``, a short read after
    ``deadline`` (``time.monotonic()``) ``TimeoutError``."""
    views = [v for v in views if len(v)]
    i, tries = 0, 0
    while i < len(views):
        if tries and deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("receive past its deadline")
        tries += 1
        try:
            n = sock.recvmsg_into(views[i : i + 1024], 0, socket.MSG_WAITALL)[0]
        except BlockingIOError:  # the socket's kernel timeout (a stall check) expired
            continue
        if n == 0:
            raise ConnectionError("peer closed the connection")
        while n and i < len(views):
            head = len(views[i])
            if n >= head:
                n -= head
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0

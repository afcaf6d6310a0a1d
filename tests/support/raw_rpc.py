"""Hand-made RPC peers for tests: raw sockets that speak (or break) the wire format on purpose."""

from __future__ import annotations

import socket

import msgpack

from kvpool.common import auth
from kvpool.common.rpc import PROTOCOL_VERSION, pack


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def request(method: str, rid: int, args: list, kwargs: dict | None = None) -> bytes:
    """One framed request ``[method, id, args, kwargs]``."""
    return frame(pack([method, rid, args, kwargs or {}]))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "peer closed the connection"
        out += chunk
    return bytes(out)


def read_frame(sock: socket.socket):
    """One framed msgpack value (fails the test if none comes within the socket timeout)."""
    header = recv_exact(sock, 4)
    return msgpack.unpackb(recv_exact(sock, int.from_bytes(header, "big")), raw=False,
                           strict_map_key=False)  # fmt: skip


raw_reply = read_frame


def handshake(sock: socket.socket, token: str | None = None, role: str = "member") -> list:
    """Run the client side of the handshake on ``sock``; the server's answer."""
    hello = read_frame(sock)
    assert hello[:2] == [PROTOCOL_VERSION, "kvpool-rpc"], hello
    nonce = auth.new_nonce()
    proof = None
    if token:
        proof = auth.proof(auth.derive_key(token, auth.RPC), b"client", hello[2], nonce)
    sock.sendall(frame(pack([PROTOCOL_VERSION, nonce, role, proof, "raw-test"])))
    return read_frame(sock)


def raw_conn(port: int, token: str | None = None, timeout: float = 5.0) -> socket.socket:
    """A connection to 127.0.0.1:``port`` past the handshake (open server, or ``token``)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    welcome = handshake(sock, token)
    assert welcome[0] is True, welcome
    return sock


def serve_handshake(conn: socket.socket, token: str | None = None) -> None:
    """The server side of the handshake, for hand-made servers (open unless ``token``)."""
    nonce = auth.new_nonce()
    conn.sendall(frame(pack([PROTOCOL_VERSION, "kvpool-rpc", nonce, token is not None])))
    hello = read_frame(conn)
    proof = None
    if token:
        proof = auth.proof(auth.derive_key(token, auth.RPC), b"server", hello[1], nonce)
    conn.sendall(frame(pack([True, proof, hello[2]])))

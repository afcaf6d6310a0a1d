"""The RPC client (one blocking TCP connection); see ``rpc.py`` for the wire format.

The calling thread sends its request and reads the reply itself: no I/O thread, no hand-off.
Each new connection first runs the handshake: it proves the cluster token (or the admin
token) and makes the server prove it too, so a request never goes to a server that does not
hold the token; a failed proof raises ``AuthError`` (never retried as a lost connection).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvpool.common import auth
from kvpool.common.errors import (
    AuthError,
    BadRequestError,
    ConnectionLostError,
    KVPoolError,
    KVPoolTimeoutError,
    ProtocolError,
)
from kvpool.common.net import spin_until_readable
from kvpool.common.rpc_server import MAX_REPLY
from kvpool.common.rpc_wire import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    error_from_body,
    frame,
    is_int,
    nodelay,
    pack,
    split_address,
    unpack,
)

logger = logging.getLogger(__name__)
_RECV = 64 << 10
_MAX_STALE = 10_000  # stale replies a client discards per call before giving up
_HANDSHAKE_BYTES = 4096


def _reply_for(payload: bytes, rid: int) -> list | None:
    """The reply in ``payload`` if it is a well-formed answer to request ``rid``."""
    try:
        reply = unpack(payload)
    except Exception:
        return None
    if not isinstance(reply, list) or len(reply) != 3 or not isinstance(reply[1], bool):
        return None
    if is_int(reply[0]) and reply[0] == rid:
        return reply
    # an error about a message the server could not read (no id): with one call in flight
    # per connection, it is about ours
    return reply if reply[0] is None and reply[1] is False else None


class _Broken(Exception):
    """The connection can no longer be trusted (closed, or a frame over the limit)."""


class RpcClient:
    """Blocking and asyncio calls to one RpcServer; thread-safe (one connection behind a lock).

    ``token``: the cluster token (None: from the environment, ``""``: none); ``admin_token``:
    connect as an admin instead (admin calls, e.g. a forced remove from the pool); ``spin``:
    seconds each call polls for its reply before sleeping (``net.spin_until_readable``).
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float = 5.0,
        max_message_size: int = MAX_REPLY,
        *,
        admin_token: str | None = None,
        spin: float = 0.0,
    ) -> None:
        self._host, self._port = split_address(address)
        self._spin = spin  # seconds a call polls for its reply before it sleeps on the socket
        self.address = address
        admin = auth.admin_token(admin_token) if admin_token is not None else None
        secret = admin if admin else auth.cluster_token(token)
        self.role = "admin" if admin else "member"
        self._key = auth.derive_key(secret, auth.RPC) if secret else None
        self.client_id = uuid.uuid4().hex  # per client object: the server counts by it
        self.timeout = timeout
        self._max_size = max_message_size
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._sock_timeout = 0.0  # what the socket's timeout is set to (each recv's bound)
        self._closed = False

    def call(self, method: str, /, *args: Any, timeout: float | None = None,
             meanwhile: Callable[[], object] | None = None, **kwargs: Any) -> Any:  # fmt: skip
        """Call ``method`` remotely; raise its typed error, or KVPoolTimeoutError.
        ``meanwhile``: work of the caller's run once the request is sent, before the reply
        is read (it overlaps the server's turn; e.g. a put's checksum during ``put_start``)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        rid = next(self._ids)
        try:
            payload = pack([method, rid, list(args), kwargs])
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadRequestError(f"arguments of {method} cannot be encoded: {exc}") from exc
        if not self._lock.acquire(timeout=max(limit, 0.0)):
            raise KVPoolTimeoutError(f"rpc {method} to {self.address}: client busy for {limit}s")
        try:
            if self._closed:
                raise KVPoolError("RpcClient is closed")
            reply = self._roundtrip(method, rid, payload, deadline, meanwhile)
        finally:
            self._lock.release()
        if reply is None:
            raise KVPoolTimeoutError(f"rpc {method} to {self.address} timed out after {limit}s")
        if reply[1]:
            return reply[2]
        raise error_from_body(reply[2], f"{method} at {self.address}")

    def _roundtrip(self, method: str, rid: int, payload: bytes, deadline: float,
                   meanwhile: Callable[[], object] | None = None) -> list | None:  # fmt: skip
        """Send and wait for the reply to ``rid`` (None on timeout; the connection is then
        replaced, so a late reply never answers a later call)."""
        try:
            sock = self._connect(deadline)
            self._set_timeout(sock, deadline)
            sock.sendall(frame(payload))
            if meanwhile is not None:
                try:
                    meanwhile()
                except BaseException:
                    self._reset()  # its reply is never read: this connection cannot be reused
                    raise
            for _ in range(_MAX_STALE):
                reply = _reply_for(self._read_frame(sock, deadline, self._max_size), rid)
                if reply is not None:
                    if reply[0] is None:
                        self._reset()  # the server may close such connections
                    return reply
                logger.debug("rpc %s: discarded a stale or malformed reply", self.address)
        except TimeoutError:
            pass
        except (OSError, _Broken) as exc:
            self._reset()
            raise ConnectionLostError(f"rpc {method} to {self.address}: {exc}") from exc
        except KVPoolError:  # a refused handshake
            self._reset()
            raise
        self._reset()
        return None

    def _set_timeout(self, sock: socket.socket, deadline: float) -> None:
        wait = max(deadline - time.monotonic(), 1e-3)
        if abs(wait - self._sock_timeout) > 0.05 * wait:  # settimeout costs two syscalls
            sock.settimeout(wait)
            self._sock_timeout = wait

    def _connect(self, deadline: float) -> socket.socket:
        if self._sock is None:
            wait = max(deadline - time.monotonic(), 1e-3)
            sock = socket.create_connection((self._host, self._port), timeout=wait)
            nodelay(sock)
            self._sock, self._buf, self._sock_timeout = sock, bytearray(), wait
            self._handshake(sock, deadline)
        return self._sock

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        """Prove our token, check the server's proof (see ``auth``)."""
        hello = self._handshake_frame(sock, deadline)
        if not (isinstance(hello, list) and len(hello) == 4 and hello[1] == MAGIC):
            raise _Broken("not a kvpool RPC server (no greeting)")
        version, _, server_nonce, required = hello
        if version != PROTOCOL_VERSION or not isinstance(server_nonce, bytes):
            raise ProtocolError(f"{self.address} speaks RPC protocol {version!r}, "
                                f"this client {PROTOCOL_VERSION}")  # fmt: skip
        nonce = auth.new_nonce()
        given = None if self._key is None else auth.proof(self._key, b"client", server_nonce, nonce)
        sock.sendall(frame(pack([PROTOCOL_VERSION, nonce, self.role, given, self.client_id])))
        welcome = self._handshake_frame(sock, deadline)
        if isinstance(welcome, list) and len(welcome) == 3 and welcome[0] is None:
            raise error_from_body(welcome[2], f"handshake with {self.address}")
        if not (isinstance(welcome, list) and len(welcome) == 3 and welcome[0] is True):
            raise _Broken("malformed handshake reply")
        if self._key is not None and not auth.proofs_match(
            welcome[1], auth.proof(self._key, b"server", nonce, server_nonce)
        ):
            raise AuthError(
                f"the server at {self.address} could not prove it holds the cluster token "
                f"({'wrong token' if required else 'it runs without one'}): not using it"
            )

    def _handshake_frame(self, sock: socket.socket, deadline: float) -> Any:
        self._set_timeout(sock, deadline)
        try:
            return unpack(self._read_frame(sock, deadline, _HANDSHAKE_BYTES))
        except (ValueError, TypeError) as exc:
            raise _Broken(f"malformed handshake frame: {exc}") from None

    def _read_frame(self, sock: socket.socket, deadline: float, limit: int) -> bytes:
        buf = self._buf
        need = 4
        while True:
            if len(buf) >= 4:
                (size,) = HEADER.unpack_from(buf, 0)
                if size > limit:
                    raise _Broken(f"reply of {size} bytes exceeds the message limit")
                need = 4 + size
                if len(buf) >= need:
                    payload = bytes(buf[4:need])
                    del buf[:need]
                    return payload
            if deadline - time.monotonic() <= 0:
                raise TimeoutError
            spin_until_readable(sock, self._spin)
            data = sock.recv(max(_RECV, need - len(buf)))
            if not data:
                raise _Broken("server closed the connection")
            buf += data

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf = bytearray()

    async def acall(
        self, method: str, /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """``call`` for asyncio code (runs on the loop's default executor)."""
        loop = asyncio.get_running_loop()
        fn = functools.partial(self.call, method, *args, timeout=timeout, **kwargs)
        return await loop.run_in_executor(None, fn)

    def retarget(self, address: str) -> None:
        """Point later calls at another server (e.g. a new master after fail-over)."""
        host, port = split_address(address)
        with self._lock:
            self._reset()
            self._host, self._port, self.address = host, port, address

    def disconnect(self) -> None:
        """Release the connection; a later call opens a new one."""
        with self._lock:
            self._reset()

    def close(self) -> None:
        """Release the connection; later calls raise KVPoolError (idempotent)."""
        with self._lock:
            self._closed = True
            self._reset()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

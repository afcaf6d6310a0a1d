"""What a connection may send the RPC server: its limits, its state, and as pure functions over
its bytes the hello with its proof of a token, then requests within their method's limits
(see ``rpc.py``)."""

from __future__ import annotations

import selectors
import socket
from dataclasses import dataclass

from kvpool.common import auth
from kvpool.common.errors import (
    AuthError,
    BadRequestError,
    KVPoolError,
    PayloadTooLargeError,
    ProtocolError,
)
from kvpool.common.rpc_dispatch import Call, CallContext, Method
from kvpool.common.rpc_wire import (
    BULK,
    HELLO,
    PROTOCOL_VERSION,
    ROLES,
    SMALL,
    is_int,
    pack,
    unpack,
)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one RPC server accepts (the defaults suit every kvpool server)."""

    max_message_size: int = BULK.max_bytes  # the largest request (bulk methods)
    handshake_timeout: float = 5.0  # seconds a new connection has to prove the token
    idle_timeout: float = 10.0  # seconds a partial frame may go without progress
    max_connections: int = 1024
    max_unauthenticated: int = 128  # of those, not past the handshake yet
    max_buffered: int = 256 << 20  # bytes of large partial frames, all connections together

    def __post_init__(self) -> None:
        if self.max_message_size < SMALL.max_bytes:
            raise ValueError(f"max_message_size must be >= {SMALL.max_bytes}")
        if min(self.handshake_timeout, self.idle_timeout) <= 0 or self.max_connections < 1:
            raise ValueError("timeouts must be > 0 and max_connections >= 1")


class Connection:
    """One client connection of an RpcServer: its socket, unparsed input, unsent output, and
    how far it got (handshake deadline, proven role, partial frame)."""

    __slots__ = ("closing", "ctx", "deadline", "inbuf", "mask", "nonce", "outbuf", "peer",
                 "pending", "ready", "reserved", "sock")  # fmt: skip

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
        self.ctx = CallContext("", "", peer)  # who it proved to be (its calls' context)
        self.pending = 0  # its requests on the worker pool
        self.reserved = 0  # bytes of the global buffer budget its partial frame holds


class Refused(Exception):
    """A message that gets an error reply instead of being served (``request_id``: what the
    reply answers; ``auth``: it failed a proof)."""

    def __init__(self, error: KVPoolError, request_id: int | None = None, auth: bool = False):
        super().__init__(error.message)
        self.error, self.request_id, self.auth = error, request_id, auth


@dataclass(frozen=True, slots=True)
class Admitted:
    role: str  # what the connection may call: "member", or "admin" (admin calls too)
    client_id: str
    welcome: bytes  # the reply to send: [true, server proof or nil, role]

    def context(self, peer: str) -> CallContext:
        return CallContext(self.client_id, self.role, peer)


@dataclass(frozen=True, slots=True)
class Gate:
    """The tokens a server accepts: ``keys`` by role (derived with ``auth.RPC``); ``open``:
    the server has no cluster token (loopback only), so members need no proof."""

    keys: dict[str, bytes]
    open: bool

    @classmethod
    def of(cls, token: str | None, admin: str | None) -> Gate:
        keys = {r: auth.derive_key(t, auth.RPC) for r, t in (("member", token), ("admin", admin))
                if t}  # fmt: skip
        return cls(keys, token is None)

    def hello(self, payload: bytes | memoryview, server_nonce: bytes) -> Admitted:
        """The client's ``[version, nonce, role, proof, client_id]``: admitted, or Refused."""
        try:
            msg = unpack(payload, HELLO)
        except Exception:
            msg = None
        if not (isinstance(msg, list) and len(msg) == 5 and is_int(msg[0])):
            raise Refused(ProtocolError("expected a hello [version, nonce, role, proof, "
                                        "client_id] first"))  # fmt: skip
        version, nonce, role, given, client_id = msg
        if version != PROTOCOL_VERSION:
            raise Refused(ProtocolError(f"unsupported protocol version {version}"))
        if not (isinstance(nonce, bytes) and len(nonce) == auth.NONCE_BYTES and role in ROLES
                and isinstance(client_id, str) and 0 < len(client_id) <= 64):  # fmt: skip
            raise Refused(ProtocolError("malformed hello"))
        key = self.keys.get(role)
        if key is not None:
            if not auth.proofs_match(given, auth.proof(key, b"client", server_nonce, nonce)):
                raise Refused(AuthError("missing or wrong auth token"), auth=True)
            reply_proof: bytes | None = auth.proof(key, b"server", nonce, server_nonce)
        elif self.open and (role == "member" or "admin" not in self.keys):
            reply_proof = None  # open mode: no authentication (loopback only)
        elif role == "admin" and not self.open:
            raise Refused(AuthError("admin calls are disabled (no admin token)"), auth=True)
        else:
            raise Refused(AuthError("missing or wrong auth token"), auth=True)
        # open without an admin token: no authorization either, every caller may do all
        granted = "admin" if role == "admin" or (self.open and "admin" not in self.keys) \
            else "member"  # fmt: skip
        return Admitted(granted, client_id, pack([True, reply_proof, granted]))


def parse_request(
    payload: bytes | memoryview, methods: dict[str, Method], ctx: CallContext
) -> Call:
    """The call in ``payload``: a short one is decoded at once (it fits every method's limits);
    of a longer one the method and id are read from the first bytes, and the rest is decoded
    only within that method's limits (else Refused, with the id when it was read)."""
    if 2 * len(payload) <= SMALL.max_items:
        try:
            msg = unpack(payload)
        except Exception as exc:
            raise Refused(ProtocolError(f"request is not msgpack: {exc}"[:200])) from None
        if not (isinstance(msg, list) and len(msg) == 4 and isinstance(msg[0], str)
                and is_int(msg[1]) and msg[1] >= 0):  # fmt: skip
            raise Refused(ProtocolError("request must be [method, id, args, kwargs]"))
        name, rid = msg[0], msg[1]
        method = methods.get(name)
        if method is None:
            raise Refused(BadRequestError(f"unknown method {name!r}"[:200]), rid)
    else:
        head = peek(payload)
        if head is None:
            raise Refused(ProtocolError("request must be [method, id, args, kwargs]"))
        name, rid = head
        method = methods.get(name)
        if method is None:
            raise Refused(BadRequestError(f"unknown method {name!r}"), rid)
        limit = method.limits.max_bytes
        if len(payload) > limit:
            raise Refused(PayloadTooLargeError(
                f"request to {name} of {len(payload)} bytes exceeds its limit of {limit}"), rid)  # fmt: skip
        try:
            msg = unpack(payload, method.limits)
        except Exception as exc:
            raise Refused(ProtocolError(f"request to {name} not decoded: {exc}"[:200]),
                          rid) from None  # fmt: skip
    if not (isinstance(msg, list) and len(msg) == 4 and isinstance(msg[2], list)
            and isinstance(msg[3], dict) and all(isinstance(k, str) for k in msg[3])):  # fmt: skip
        raise Refused(ProtocolError("args must be an array and kwargs a map"), rid)
    return Call(rid, method, msg[2], msg[3], ctx)


_UINT = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def peek(payload: bytes | memoryview) -> tuple[str, int] | None:
    """``(method, request id)`` from the first bytes of ``[method, id, args, kwargs]``: a
    fixarray of 4, a fixstr, then a non-negative integer (nothing else is decoded)."""
    head = bytes(payload[:44])  # the most a method name and an id take
    if len(head) < 3 or head[0] != 0x94 or not 0xA0 <= head[1] <= 0xBF:
        return None
    i = 2 + (head[1] & 0x1F)
    if len(head) <= i:
        return None
    try:
        name = head[2:i].decode("ascii")
    except UnicodeDecodeError:
        return None
    tag = head[i]
    if tag <= 0x7F:
        return name, tag
    width = _UINT.get(tag, 0)
    if not width or len(head) < i + 1 + width:
        return None
    return name, int.from_bytes(head[i + 1 : i + 1 + width], "big")

"""The control-plane RPC: msgpack messages over plain TCP connections (DESIGN.md §3).

Wire format: every message is a 4-byte big-endian length followed by that many bytes holding
one msgpack value (``use_bin_type``, so bytes stay bytes and str stays str).

A connection starts with a handshake (protocol version 2)::

    server  [2, "kvpool-rpc", server_nonce (16 bytes), token_required]
    client  [2, client_nonce (16 bytes), role ("member" | "admin"), proof or nil, client_id]
    server  [true, server_proof or nil, granted role]     or an error reply, then it closes

``proof = HMAC-SHA256(key, "client|" + server_nonce + "|" + client_nonce)`` and
``server_proof = HMAC-SHA256(key, "server|" + client_nonce + "|" + server_nonce)``, where
``key`` is derived from the cluster token (role member) or the admin token (role admin): the
token never crosses the wire, a replayed proof is useless, and a client refuses a server that
cannot prove the token in return. Before the handshake a connection may send only its hello
(at most 512 bytes, within 5 s). A server without a cluster token runs *open* (loopback only):
no proof is asked, and without an admin token every caller may make admin calls too.

Then::

    request  [method, request_id, args, kwargs]
             method str (at most 31 ASCII characters: the server reads it, and the id, from
             the first bytes, and decodes the rest only if the size fits the method's limits),
             request_id a non-negative int chosen by the client, args list, kwargs map of str
    reply    [request_id, ok, result_or_error]
             ok true:  the handler's return value
             ok false: {"type": error class name, "message": str, "param": str or nil,
                        "http_status": int, "error_type": str, "attrs": {extra attributes}}

A request that cannot be parsed gets a ProtocolError reply (request_id nil unless one could be
read) and the connection stays usable. A request over its method's limits (``SMALL``: 64 KiB
and 4,096 elements, ``BULK``: 8 MiB and 65,536 elements) gets a PayloadTooLargeError or
ProtocolError reply. A length over the server's limit gets an error reply with a nil id and
the server then closes the connection, because the stream can no longer be trusted. Values:
nil, bool, int (64-bit), float, str, bytes, list, map; tuples arrive as lists.

The server is one thread multiplexing every connection with epoll (handlers inline, or on a
pool). The client keeps one connection and the calling thread writes its request and reads its
reply itself, so a round trip costs two system calls on each side and no thread hand-off (the
ZeroMQ transport this replaced moved every message through its I/O threads: ~4x slower here,
see docs/benchmarks.md). The client matches replies by request_id and discards any other;
after a timeout it drops the connection, so a late reply never answers a later call. A server
that cannot be reached raises ConnectionLostError (an UnavailableError) at once.
"""

from __future__ import annotations

from kvpool.common.errors import AuthError, ForbiddenError
from kvpool.common.rpc_admit import ServerLimits
from kvpool.common.rpc_client import RpcClient
from kvpool.common.rpc_dispatch import (
    LATENCY_BUCKETS,
    CallContext,
    LatencyHistogram,
    current_call,
    rpc_method,
    rpc_methods,
)
from kvpool.common.rpc_server import MAX_REPLY, RpcServer
from kvpool.common.rpc_wire import (
    BULK,
    PROTOCOL_VERSION,
    SMALL,
    Limits,
    error_body,
    error_from_body,
    pack,
    unpack,
)

__all__ = [
    "BULK",
    "LATENCY_BUCKETS",
    "MAX_REPLY",
    "PROTOCOL_VERSION",
    "SMALL",
    "AuthError",
    "CallContext",
    "ForbiddenError",
    "LatencyHistogram",
    "Limits",
    "RpcClient",
    "RpcServer",
    "ServerLimits",
    "current_call",
    "error_body",
    "error_from_body",
    "pack",
    "rpc_method",
    "rpc_methods",
    "unpack",
]

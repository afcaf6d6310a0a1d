"""The control-plane RPC: msgpack messages over plain TCP connections (DESIGN.md §3).

Wire format: every message is a 4-byte big-endian length followed by that many bytes holding
one msgpack value (``use_bin_type``, so bytes stay bytes and str stays str; map keys may be any
scalar)::

    request  [version, request_id, method, args, kwargs, token]
             version int (PROTOCOL_VERSION), request_id int chosen by the client,
             method str, args list, kwargs map of str, token str or nil
    reply    [request_id, ok, result_or_error]
             ok true:  the handler's return value
             ok false: {"type": error class name, "message": str, "param": str or nil,
                        "http_status": int, "error_type": str, "attrs": {extra attributes}}

A request that cannot be parsed gets a ProtocolError reply (request_id nil unless one could be
read) and the connection stays usable. A length over the limit (``max_message_size``, 64 MiB by
default) gets a ProtocolError reply with a nil id, and the server then closes the connection,
because the stream can no longer be trusted. Values: nil, bool, int (64-bit), float, str, bytes,
list, map; tuples arrive as lists.

The server is one thread multiplexing every connection with epoll (handlers inline, or on a
pool). The client keeps one connection and the calling thread writes its request and reads its
reply itself, so a round trip costs two system calls on each side and no thread hand-off (the
ZeroMQ transport this replaced moved every message through its I/O threads: ~4x slower here,
see docs/benchmarks.md). The client matches replies by request_id and discards any other;
after a timeout it drops the connection, so a late reply never answers a later call. A server
that cannot be reached raises ConnectionLostError (an UnavailableError) at once.
"""

from __future__ import annotations

from kvpool.common.rpc_client import RpcClient
from kvpool.common.rpc_server import (
    DEFAULT_MAX_MESSAGE_SIZE,
    LATENCY_BUCKETS,
    PROTOCOL_VERSION,
    LatencyHistogram,
    RpcServer,
    rpc_method,
)
from kvpool.common.rpc_wire import AuthError, error_body, error_from_body, pack, unpack

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "LATENCY_BUCKETS",
    "PROTOCOL_VERSION",
    "AuthError",
    "LatencyHistogram",
    "RpcClient",
    "RpcServer",
    "error_body",
    "error_from_body",
    "pack",
    "rpc_method",
    "unpack",
]

"""The control-plane RPC: ZeroMQ ROUTER/DEALER sockets carrying msgpack (DESIGN.md §3).

Wire format: every message is one ZeroMQ frame holding one msgpack value (``use_bin_type``, so
bytes stay bytes and str stays str; map keys may be any scalar)::

    request  [version, request_id, method, args, kwargs, token]
             version int (PROTOCOL_VERSION), request_id int chosen by the client,
             method str, args list, kwargs map of str, token str or nil
    reply    [request_id, ok, result_or_error]
             ok true:  the handler's return value
             ok false: {"type": error class name, "message": str, "param": str or nil,
                        "http_status": int, "error_type": str, "attrs": {extra attributes}}

Clients use DEALER sockets, so the server's ROUTER sees ``[identity, payload]`` and answers
``[identity, reply]``. A request that cannot be parsed gets a ProtocolError reply (request_id
nil unless one could be read); one that is too large (``zmq.MAXMSGSIZE``) is dropped by ZeroMQ,
which disconnects the peer. Values: nil, bool, int (64-bit), float, str, bytes, list, map;
tuples arrive as lists. The client matches replies by request_id and discards any other, and
after a timeout it replaces its socket, so a late reply never answers a later call.
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

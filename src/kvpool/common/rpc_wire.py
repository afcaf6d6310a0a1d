"""The RPC's wire codec (see ``rpc.py``): frames, bounded msgpack decoding, typed errors as maps,
and the handshake messages."""

from __future__ import annotations

import contextlib
import socket
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from kvpool.common import errors
from kvpool.common.errors import AuthError, KVPoolError

PROTOCOL_VERSION = 2
MAGIC = "kvpool-rpc"
HEADER = struct.Struct(">I")  # the length of the msgpack payload that follows
MAX_HELLO_BYTES = 512  # the only frame a connection may send before it has authenticated
MAX_METHOD_NAME = 31  # a request starts with [fixarray(4), fixstr(method)]: read, not parsed
ROLES = ("member", "admin")

_SIMPLE = (str, int, float, bool, bytes, type(None))
_RESERVED = frozenset({"args", "message", "param", "http_status", "error_type"})

_ERRORS: dict[str, type[KVPoolError]] = {
    c.__name__: c
    for c in vars(errors).values()
    if isinstance(c, type) and issubclass(c, KVPoolError)
}

__all__ = ["AuthError", "Limits", "error_body", "error_from_body", "pack", "unpack"]


@dataclass(frozen=True, slots=True)
class Limits:
    """What one message may hold: ``max_bytes`` on the wire, ``max_items`` array and map
    elements in all (so decoding allocates at most ~72 bytes per item beyond the payload)."""

    max_bytes: int
    max_items: int

    def capped(self, max_bytes: int) -> Limits:
        return self if self.max_bytes <= max_bytes else Limits(max_bytes, self.max_items)


SMALL = Limits(64 << 10, 4096)  # control calls: a key, a few numbers
BULK = Limits(8 << 20, 1 << 16)  # batches, token ids, an index report
HELLO = Limits(MAX_HELLO_BYTES, 16)


class TooLarge(ValueError):
    """A message with more elements than its limits allow (decoding stopped there)."""


def pack(obj: Any) -> bytes:
    """msgpack-encode ``obj`` the way the RPC does."""
    return msgpack.packb(obj, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} not allowed")


def unpack(data: Any, limits: Limits | None = None) -> Any:
    """msgpack-decode ``data`` (bytes or a buffer); with ``limits``, refuse (``ValueError``)
    any string, array or map over them and stop as soon as the element budget runs out."""
    # each value costs a byte at least and is counted at most twice (in its container, and as
    # a container): a message this short cannot run out of budget, and needs no counting
    if limits is None or 2 * len(data) <= limits.max_items:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_no_ext)
    left = limits.max_items

    def count(obj: Any) -> Any:
        nonlocal left
        left -= len(obj) + 1
        if left < 0:
            raise TooLarge(f"message has over {limits.max_items} elements")
        return obj

    n = limits.max_items
    return msgpack.unpackb(
        data, raw=False, strict_map_key=False, ext_hook=_no_ext, max_str_len=limits.max_bytes,
        max_bin_len=limits.max_bytes, max_array_len=n, max_map_len=n, max_ext_len=0,
        list_hook=count, object_hook=count,
    )  # fmt: skip


def frame(payload: bytes) -> bytes:
    """``payload`` with its length header (one buffer: one send)."""
    return HEADER.pack(len(payload)) + payload


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def url_host(host: str) -> str:
    host = "127.0.0.1" if host == "localhost" else host
    return f"[{host}]" if ":" in host else host


def nodelay(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- errors as maps ---------------------------------------------------------------------------


def error_body(exc: KVPoolError) -> dict:
    """The wire form of a KVPoolError (simple extra attributes travel along)."""
    attrs = {
        k: v
        for k, v in vars(exc).items()
        if k not in _RESERVED and not k.startswith("_") and isinstance(v, _SIMPLE)
    }
    param = getattr(exc, "param", None)
    return {
        "type": type(exc).__name__,
        "message": str(getattr(exc, "message", exc)),
        "param": None if param is None else str(param),
        "http_status": int(exc.http_status),
        "error_type": str(exc.error_type),
        "attrs": attrs,
    }


def error_from_body(body: Any, where: str = "") -> KVPoolError:
    """Rebuild the error of a reply as its kvpool.common.errors class (else KVPoolError)."""
    body = body if isinstance(body, dict) else {}
    name = body.get("type")
    cls = _ERRORS.get(name, KVPoolError) if isinstance(name, str) else KVPoolError
    message = str(body.get("message", "remote error"))
    exc = cls.__new__(cls)  # not cls(): subclasses have their own constructor arguments
    exc.args = (message,)
    exc.message = message
    exc.param = body.get("param") if isinstance(body.get("param"), str) else None
    attrs = body.get("attrs") if isinstance(body.get("attrs"), dict) else {}
    for k, v in attrs.items():
        if (
            isinstance(k, str)
            and k.isidentifier()
            and not k.startswith("_")
            and k not in _RESERVED
            and isinstance(v, _SIMPLE)
            and not callable(getattr(cls, k, None))
        ):
            setattr(exc, k, v)
    if cls is KVPoolError:  # a class this side does not know: keep its status and type
        if is_int(body.get("http_status")):
            exc.http_status = body["http_status"]
        if isinstance(body.get("error_type"), str):
            exc.error_type = body["error_type"]
    if where:
        exc.add_note(f"raised by {where}")
    return exc


def error_reply(request_id: int | None, exc: KVPoolError) -> bytes:
    return pack([request_id, False, error_body(exc)])

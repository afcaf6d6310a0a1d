"""The RPC's wire codec: msgpack values, and typed errors as maps (see ``rpc.py``)."""

from __future__ import annotations

from typing import Any

import msgpack

from kvpool.common import errors
from kvpool.common.errors import KVPoolError

_SIMPLE = (str, int, float, bool, bytes, type(None))
_RESERVED = frozenset({"args", "message", "param", "http_status", "error_type"})


class AuthError(KVPoolError):
    """A control call with a missing or wrong shared secret."""

    http_status = 401
    error_type = "authentication_error"


_ERRORS: dict[str, type[KVPoolError]] = {
    c.__name__: c
    for c in [*vars(errors).values(), AuthError]
    if isinstance(c, type) and issubclass(c, KVPoolError)
}


def pack(obj: Any) -> bytes:
    """msgpack-encode ``obj`` the way the RPC does."""
    return msgpack.packb(obj, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} not allowed")


def unpack(data: bytes) -> Any:
    """msgpack-decode ``data`` the way the RPC does (extension types rejected)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_no_ext)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
        if _is_int(body.get("http_status")):
            exc.http_status = body["http_status"]
        if isinstance(body.get("error_type"), str):
            exc.error_type = body["error_type"]
    if where:
        exc.add_note(f"raised by {where}")
    return exc

"""What an RpcServer exposes and how one call runs: ``@rpc_method`` (with the call's size class
and role), the method table, the caller's context, and the latency histogram."""

from __future__ import annotations

import bisect
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.common.errors import BadRequestError, ForbiddenError, KVPoolError
from kvpool.common.rpc_wire import BULK, MAX_METHOD_NAME, SMALL, Limits, error_body, pack

logger = logging.getLogger(__name__)

MARK = "__kvpool_rpc__"


def rpc_method(fn: Callable | None = None, *, bulk: bool = False, admin: bool = False):
    """Expose a method of a handler object to RPC callers (nothing else is exposed).

    ``bulk``: its requests may be large (batches, token ids; ``BULK`` limits instead of
    ``SMALL``); ``admin``: only callers authenticated with the admin token may call it.
    """

    def mark(f: Callable) -> Callable:
        setattr(f, MARK, (BULK if bulk else SMALL, admin))
        return f

    return mark(fn) if fn is not None else mark


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    fn: Callable
    limits: Limits
    admin: bool
    signature: inspect.Signature | None


@dataclass(frozen=True, slots=True)
class CallContext:
    """Who is calling: the client's self-chosen id (per client object), its proven role and
    its address. Outside an RPC call (a handler called in-process) the caller is local."""

    client_id: str
    role: str
    peer: str


LOCAL = CallContext("local", "admin", "in-process")
_current = threading.local()


def current_call() -> CallContext:
    """The context of the RPC call this thread is running (``LOCAL`` outside any)."""
    return getattr(_current, "ctx", LOCAL)


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def rpc_methods(*handlers: Any) -> dict[str, Callable]:
    """The ``@rpc_method`` methods of several objects as one ``name -> method`` dict (for one
    RpcServer serving them all; the marks travel with the bound methods)."""
    out: dict[str, Callable] = {}
    for handler in handlers:
        for name in dir(type(handler)):
            raw = inspect.getattr_static(type(handler), name, None)
            if not name.startswith("_") and getattr(getattr(raw, "__func__", raw), MARK, None):
                if name in out:
                    raise ValueError(f"two handlers expose an RPC method {name!r}")
                out[name] = getattr(handler, name)
    return out


def method_table(handler: Any, max_bytes: int) -> dict[str, Method]:
    """The methods of a ``name -> callable`` dict (``SMALL`` limits unless the callable is
    marked) or of an object's ``@rpc_method`` methods, with limits capped at ``max_bytes``."""
    table: dict[str, Method] = {}
    if isinstance(handler, Mapping):
        for name, fn in handler.items():
            if not isinstance(name, str) or not callable(fn):
                raise TypeError(f"RPC handler dict needs str -> callable, bad entry: {name!r}")
            limits, admin = getattr(fn, MARK, (SMALL, False))
            table[name] = Method(name, fn, limits.capped(max_bytes), admin, _signature(fn))
    else:
        for name in dir(type(handler)):
            raw = inspect.getattr_static(type(handler), name, None)  # no property side effects
            mark = getattr(getattr(raw, "__func__", raw), MARK, None)
            if not name.startswith("_") and mark:
                fn = getattr(handler, name)
                table[name] = Method(name, fn, mark[0].capped(max_bytes), mark[1], _signature(fn))
        if not table:
            raise ValueError(f"{type(handler).__name__} has no @rpc_method methods")
    for name, m in table.items():
        if not name.isascii() or not 0 < len(name) <= MAX_METHOD_NAME:
            raise ValueError(
                f"RPC method names are 1..{MAX_METHOD_NAME} ASCII characters: {name!r}"
            )
        if inspect.iscoroutinefunction(m.fn):
            raise TypeError(f"RPC method {name!r} must be synchronous")
    return table


LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # fmt: skip


class LatencyHistogram:
    """Cumulative bucket counts (Prometheus style), cheap enough for every call."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            self.counts[i] += 1
            self.total += seconds

    def buckets(self) -> tuple[list[tuple[str, int]], float]:
        """``([(le, cumulative count), ..., ("+Inf", n)], sum)``."""
        with self._lock:
            counts, total = list(self.counts), self.total
        out, running = [], 0
        for bound, n in zip((*LATENCY_BUCKETS, None), counts, strict=True):
            running += n
            out.append(("+Inf" if bound is None else repr(bound), running))
        return out, total


@dataclass(slots=True)
class Call:
    """One parsed request, ready to run."""

    request_id: int
    method: Method
    args: list
    kwargs: dict
    ctx: CallContext


def execute(call: Call, max_reply: int, latency: LatencyHistogram, stats: dict) -> bytes:
    """Run ``call``; its packed reply (a typed error reply on any failure)."""
    m = call.method
    if m.admin and call.ctx.role != "admin":
        stats["errors"] += 1
        err = ForbiddenError(f"{m.name} is an admin call: connect with the admin token")
        return pack([call.request_id, False, error_body(err)])
    t0 = time.perf_counter()
    _current.ctx = call.ctx
    try:
        data = pack([call.request_id, True, m.fn(*call.args, **call.kwargs)])
        latency.observe(time.perf_counter() - t0)
        if len(data) <= max_reply:
            return data
        error: KVPoolError = KVPoolError(f"result of {m.name} exceeds the message limit")
    except KVPoolError as exc:
        error = exc
    except TypeError as exc:
        error = _argument_error(call, exc)
    except Exception:
        logger.exception("rpc: internal error in %s", m.name)
        error = KVPoolError(f"internal error in {m.name}")
    finally:
        _current.ctx = LOCAL
    stats["errors"] += 1
    return pack([call.request_id, False, error_body(error)])


def _argument_error(call: Call, exc: TypeError) -> KVPoolError:
    """A TypeError is the caller's fault when the arguments do not fit the signature
    (checked only now, off the fast path); otherwise it is an internal error."""
    sig = call.method.signature
    try:
        if sig is not None:
            sig.bind(*call.args, **call.kwargs)
    except TypeError as bad:
        return BadRequestError(f"bad arguments for {call.method.name}: {bad}"[:300])
    logger.error("rpc: internal error in %s: %s", call.method.name, exc, exc_info=exc)
    return KVPoolError(f"internal error in {call.method.name}")

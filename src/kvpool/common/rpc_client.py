"""The RPC client (DEALER socket); see ``rpc.py`` for the wire format."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from typing import Any

import zmq

from kvpool.common.errors import BadRequestError, KVPoolError, KVPoolTimeoutError
from kvpool.common.rpc_server import (
    _MAX_STALE,
    DEFAULT_MAX_MESSAGE_SIZE,
    PROTOCOL_VERSION,
    _is_int,
    _new_socket,
    _split_address,
    _url_host,
)
from kvpool.common.rpc_wire import error_from_body, pack, unpack

logger = logging.getLogger(__name__)


def _reply_for(frames: list[bytes], rid: int) -> list | None:
    """The reply in ``frames`` if it is a well-formed answer to request ``rid``."""
    try:
        reply = unpack(frames[-1])
    except Exception:
        return None
    if isinstance(reply, list) and len(reply) == 3 and _is_int(reply[0]) and reply[0] == rid:
        return reply if isinstance(reply[1], bool) else None
    return None


class RpcClient:
    """Blocking and asyncio calls to one RpcServer; thread-safe (one DEALER behind a lock)."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float = 5.0,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        self._host, self._port = _split_address(address)
        self.address = address
        self.token = token
        self.timeout = timeout
        self._max_size = max_message_size
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._closed = False

    def call(self, method: str, /, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Call ``method`` remotely; raise its typed error, or KVPoolTimeoutError."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        rid = next(self._ids)
        try:
            payload = pack([PROTOCOL_VERSION, rid, method, list(args), kwargs, self.token])
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadRequestError(f"arguments of {method} cannot be encoded: {exc}") from exc
        if len(payload) > self._max_size:
            raise BadRequestError(f"request to {method} exceeds the message limit")
        if not self._lock.acquire(timeout=max(limit, 0.0)):
            raise KVPoolTimeoutError(f"rpc {method} to {self.address}: client busy for {limit}s")
        try:
            if self._closed:
                raise KVPoolError("RpcClient is closed")
            reply = self._roundtrip(rid, payload, deadline)
        finally:
            self._lock.release()
        if reply is None:
            raise KVPoolTimeoutError(f"rpc {method} to {self.address} timed out after {limit}s")
        if reply[1]:
            return reply[2]
        raise error_from_body(reply[2], f"{method} at {self.address}")

    def _roundtrip(self, rid: int, payload: bytes, deadline: float) -> list | None:
        """Send and wait for the reply to ``rid`` (None on timeout, socket then replaced)."""
        if self._sock is None:
            self._sock = _new_socket(zmq.DEALER, self._max_size, ":" in self._host)
            self._sock.connect(f"tcp://{_url_host(self._host)}:{self._port}")
        sock = self._sock
        try:  # socket timeouts instead of poll(): one syscall less per call
            sock.setsockopt(zmq.SNDTIMEO, max(0, int((deadline - time.monotonic()) * 1000)))
            sock.send(payload)
            for _ in range(_MAX_STALE):
                wait_ms = int((deadline - time.monotonic()) * 1000)
                if wait_ms <= 0:
                    break
                sock.setsockopt(zmq.RCVTIMEO, wait_ms)
                reply = _reply_for(sock.recv_multipart(), rid)
                if reply is not None:
                    return reply
                logger.debug("rpc %s: discarded a stale or malformed reply", self.address)
        except zmq.Again:
            pass
        self._reset()  # a late reply must not reach a later call
        return None

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def acall(
        self, method: str, /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """``call`` for asyncio code (runs on the loop's default executor)."""
        loop = asyncio.get_running_loop()
        fn = functools.partial(self.call, method, *args, timeout=timeout, **kwargs)
        return await loop.run_in_executor(None, fn)

    def retarget(self, address: str) -> None:
        """Point later calls at another server (e.g. a new master after fail-over)."""
        host, port = _split_address(address)
        with self._lock:
            self._reset()
            self._host, self._port, self.address = host, port, address

    def close(self) -> None:
        """Release the socket; later calls raise KVPoolError (idempotent)."""
        with self._lock:
            self._closed = True
            self._reset()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Connections to one RPC server, reused: a call takes an idle client (or opens one), and
gives it back when done. ``RpcClient`` is one connection with one call in flight; a caller
that makes concurrent calls to the same server (the conductor's prefill hand-offs, each
taking seconds) would otherwise open a connection, and run a handshake, per call."""

from __future__ import annotations

import threading
from typing import Any

from kvpool.common.rpc_client import RpcClient


class RpcPool:
    """Thread-safe; keeps at most ``max_idle`` idle connections (more are closed)."""

    def __init__(self, address: str, token: str | None = None, timeout: float = 5.0,
                 max_idle: int = 8) -> None:  # fmt: skip
        self.address = address
        self._token, self._timeout, self._max_idle = token, timeout, max_idle
        self._idle: list[RpcClient] = []
        self._lock = threading.Lock()
        self._closed = False
        self.opened = 0  # connections opened over the pool's life

    def call(self, method: str, /, *args: Any, timeout: float | None = None, **kwargs) -> Any:
        client = self._take()
        try:
            return client.call(method, *args, timeout=timeout, **kwargs)
        finally:
            self._give(client)

    def _take(self) -> RpcClient:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.opened += 1
        return RpcClient(self.address, token=self._token, timeout=self._timeout)

    def _give(self, client: RpcClient) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(client)  # a broken one reconnects on its next call
                return
        client.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()

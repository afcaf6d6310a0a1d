"""The connection of clients and nodes to the store master, following fail-over.

``master`` is ``HOST:PORT`` (one fixed master) or ``etcd://HOST:PORT[,HOST:PORT]`` (find the
leader in etcd). With etcd, a call that times out or finds no master looks the leader up again
and retries, until ``failover_timeout``: callers ride through a leader change.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvpool.common.errors import (
    ConnectionLostError,
    KVPoolError,
    KVPoolTimeoutError,
    UnavailableError,
)
from kvpool.common.etcd import EtcdClient, EtcdError
from kvpool.common.rpc import RpcClient

logger = logging.getLogger(__name__)


class NoLeaderError(UnavailableError):
    """No master leads right now (an election is under way)."""


class MasterLink:
    """``call`` the current master."""

    def __init__(
        self,
        master: str,
        token: str | None = None,
        timeout: float = 10.0,
        failover_timeout: float = 15.0,
        admin_token: str | None = None,
        spin: float = 0.0,
    ) -> None:
        self.etcd = EtcdClient(master[len("etcd://") :]) if master.startswith("etcd://") else None
        self.failover_timeout = failover_timeout
        self.timeout = timeout
        # with etcd, a dead leader must be noticed fast: short calls, retried on the new one
        call_timeout = min(timeout, 2.0) if self.etcd else timeout
        self.rpc = RpcClient(self._resolve() if self.etcd else master, token, call_timeout,
                             admin_token=admin_token, spin=spin)  # fmt: skip

    def _resolve(self) -> str:
        from kvpool.store.master.ha import leader_address

        deadline = time.monotonic() + self.failover_timeout
        while True:
            try:
                address = leader_address(self.etcd)
            except EtcdError as exc:
                address = None
                logger.warning("store: etcd lookup of the leader failed: %s", exc)
            if address:
                return address
            if time.monotonic() > deadline:
                raise NoLeaderError("no store master leads (etcd has no leader key)")
            time.sleep(0.1)

    @property
    def address(self) -> str:
        return self.rpc.address

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.etcd is None:
            return self.rpc.call(method, *args, **kwargs)
        deadline = time.monotonic() + self.failover_timeout
        while True:
            try:
                return self.rpc.call(method, *args, **kwargs)
            except (KVPoolTimeoutError, UnavailableError) as exc:
                if time.monotonic() > deadline:
                    raise
                logger.info("store: master %s did not answer (%s); looking up the leader",
                            self.rpc.address, exc)  # fmt: skip
                if not isinstance(exc, (NoLeaderError, ConnectionLostError, KVPoolTimeoutError)):
                    time.sleep(0.1)  # the leader is rebuilding its table: ask it again soon
                    continue
                address = self._resolve()
                if address != self.rpc.address:
                    self.rpc.retarget(address)
                else:  # etcd still names the dead leader until its lease runs out
                    time.sleep(0.1)

    def retarget(self, address: str) -> None:
        self.rpc.retarget(address)

    def close(self) -> None:
        self.rpc.close()


__all__ = ["KVPoolError", "MasterLink", "NoLeaderError"]

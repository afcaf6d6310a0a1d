"""Master high availability through etcd: exactly one master leads.

Every master campaigns for the key ``/kvpool/store/leader``: it creates the key (value: its
RPC address) bound to its own lease, or, if the key exists, watches it by polling. The leader
renews its lease every ttl/3; if it dies, its lease expires after ``ttl`` and a standby wins
the next campaign, starts serving, and rebuilds the object table as the nodes (which find the
leader in the same key) mount again and report their contents.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvpool.common.etcd import EtcdClient, EtcdError

logger = logging.getLogger(__name__)

LEADER_KEY = b"/kvpool/store/leader"


def leader_address(etcd: EtcdClient) -> str | None:
    """The current leader's RPC address, or None while there is none."""
    raw = etcd.get(LEADER_KEY)
    return raw.decode() if raw else None


class LeaderElection:
    """Campaign in a background thread; ``on_elected`` runs once when this master wins, and
    ``on_lost`` if it ever loses the lease (it must then stop serving: another may lead)."""

    def __init__(
        self,
        etcd: EtcdClient,
        address: str,
        on_elected: Callable[[], None],
        on_lost: Callable[[], None],
        ttl: float = 3.0,
        poll: float = 0.2,
    ) -> None:
        self.etcd = etcd
        self.address = address
        self.ttl = ttl
        self.poll = poll
        self._on_elected = on_elected
        self._on_lost = on_lost
        self.leading = False
        self._lease = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-election", daemon=True)

    def start(self) -> LeaderElection:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.leading:
                    self._keep()
                else:
                    self._campaign()
            except EtcdError as exc:
                logger.warning("election: etcd unavailable: %s", exc)
                if self.leading and not self._renewable():
                    self._lose("etcd unreachable for longer than the lease")
            self._stop.wait(self.ttl / 3 if self.leading else self.poll)

    def _campaign(self) -> None:
        if self.etcd.get(LEADER_KEY) is not None:
            return
        lease = self.etcd.lease_grant(self.ttl)
        if self.etcd.create(LEADER_KEY, self.address.encode(), lease):
            self._lease = lease
            self.leading = True
            logger.info("election: %s leads", self.address)
            self._on_elected()
        else:
            self.etcd.lease_revoke(lease)

    def _keep(self) -> None:
        if self.etcd.lease_keepalive(self._lease) <= 0:
            self._lose("lease expired")

    def _renewable(self) -> bool:
        return False  # one failed renewal with etcd down: step down rather than risk two leaders

    def _lose(self, why: str) -> None:
        logger.error("election: %s lost the leadership: %s", self.address, why)
        self.leading = False
        self._lease = 0
        self._on_lost()

    def close(self) -> None:
        """Stop campaigning; a leader resigns (its key goes at once, not after the ttl)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.leading and self._lease:
            try:
                self.etcd.lease_revoke(self._lease)
            except EtcdError as exc:
                logger.warning("election: resigning failed: %s", exc)
            self.leading = False

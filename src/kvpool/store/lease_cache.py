"""Replica locations of objects this client holds a read lease on.

A get makes the master grant a read lease (``lease_ttl``, 10 s by default) that blocks the
object's eviction and removal. While that lease lasts, the object cannot move or disappear
(short of a forced remove), so a repeated read can go straight to the replica it named,
without asking the master again: the read is still checked against the object's checksum, and
any failure (a checksum mismatch after a forced remove, a dead node) drops the entry and asks
the master. Entries expire ``margin_s`` before the lease, measured from before the request
that obtained it, so the client never relies on a lease the master already let go.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kvpool.protocol.store import ObjectDesc


class LeaseCache:
    def __init__(self, enabled: bool = True, margin_s: float = 1.0,
                 max_entries: int = 65536) -> None:  # fmt: skip
        self.enabled = enabled
        self.margin_s = margin_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, ObjectDesc]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> ObjectDesc | None:
        if not self.enabled:
            return None
        entry = self._entries.get(key)
        if entry is not None and entry[0] > time.monotonic():
            self.hits += 1
            return entry[1]
        if entry is not None:
            self._entries.pop(key, None)
        self.misses += 1
        return None

    def put(self, key: str, meta: ObjectDesc | None, asked_at: float) -> None:
        """Remember ``meta`` of a get sent at ``asked_at`` (``time.monotonic()``)."""
        if not self.enabled or meta is None or not meta.lease_ttl:
            return
        until = asked_at + meta.lease_ttl - self.margin_s
        if until <= time.monotonic():
            return
        self._entries[key] = (until, meta)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

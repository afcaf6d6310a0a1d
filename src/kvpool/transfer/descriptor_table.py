"""One owner per segment name: the descriptor table behind the in-process directory, the
HTTP metadata service and the store master's directory (``metadata.py``)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable

from kvpool.common.errors import AlreadyExistsError
from kvpool.transfer.segment import SegmentDescriptor, owner_is_dead

logger = logging.getLogger(__name__)


def _key_digest(owner_key: str) -> bytes:
    return hashlib.sha256(owner_key.encode()).digest()


class DescriptorTable:
    """Descriptors by name, one owner per name (the in-process store and the HTTP service's).

    An entry remembers the digest of its owner key; ``put`` and ``delete`` need the same key.
    A name held by another owner is handed over only if ``is_dead(old descriptor)``.
    """

    def __init__(self, is_dead: Callable[[SegmentDescriptor], bool] = owner_is_dead) -> None:
        self._entries: dict[str, tuple[SegmentDescriptor, bytes, float]] = {}
        self._lock = threading.Lock()
        self._is_dead = is_dead

    def put(self, desc: SegmentDescriptor, owner_key: str, ttl: float | None = None) -> None:
        """Insert or renew; ``AlreadyExistsError`` if another live owner holds the name."""
        digest = _key_digest(owner_key)
        with self._lock:
            old = self._entries.get(desc.name) if self._live(desc.name) else None
        if old is not None and not hmac.compare_digest(old[1], digest):
            # not the same owner key: taken over only from a dead owner (checked unlocked:
            # it may dial the old owner)
            if old[0].owner_id == desc.owner_id or not self._is_dead(old[0]):
                raise AlreadyExistsError(f"segment {desc.name!r} is already registered")
            logger.info("segment %s: owner %s is gone; handed to %s", desc.name,
                        old[0].owner_id, desc.owner_id)  # fmt: skip
        expires = float("inf") if ttl is None else time.monotonic() + ttl
        with self._lock:
            cur = self._entries.get(desc.name) if self._live(desc.name) else None
            if cur is not None and cur[1] != digest and (old is None or cur[1] != old[1]):
                raise AlreadyExistsError(f"segment {desc.name!r} is already registered")
            self._entries[desc.name] = (desc, digest, expires)

    def delete(self, name: str, owner_key: str) -> bool:
        """Withdraw ``name`` if ``owner_key`` is the one it was published with."""
        with self._lock:
            entry = self._entries.get(name) if self._live(name) else None
            if entry is None or not hmac.compare_digest(entry[1], _key_digest(owner_key)):
                return False
            del self._entries[name]
            return True

    def get(self, name: str) -> SegmentDescriptor | None:
        with self._lock:
            return self._live(name)

    def all(self) -> list[SegmentDescriptor]:
        with self._lock:
            return [d for d in (self._live(n) for n in list(self._entries)) if d is not None]

    def _live(self, name: str) -> SegmentDescriptor | None:
        entry = self._entries.get(name)
        if entry is None:
            return None
        if entry[2] < time.monotonic():
            del self._entries[name]
            return None
        return entry[0]

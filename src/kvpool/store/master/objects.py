"""The master's object table entries: objects, their replicas, states, leases, access stats."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from kvpool.protocol.store import PutOptions  # noqa: F401 - the master's modules use it from here


class Tier(StrEnum):
    DRAM = "dram"
    SSD = "ssd"


class ObjectState(StrEnum):
    PROCESSING = "processing"  # put started: bytes are being written, invisible to gets
    COMPLETE = "complete"  # put ended: immutable and visible


@dataclass(slots=True)
class Replica:
    """Where one copy of an object's bytes lives."""

    node_id: str
    segment: str  # the node's segment name (DRAM: a transfer-engine segment; SSD: its tier id)
    offset: int
    tier: Tier


@dataclass(slots=True)
class ObjectMeta:
    """One key: size, replicas, state, lease, pin and access statistics."""

    key: str
    size: int
    replicas: list[Replica]
    created: float
    state: ObjectState = ObjectState.PROCESSING
    put_deadline: float = 0.0  # a PROCESSING put not ended by then is revoked
    lease_until: float = 0.0  # reads hold it; eviction and removal wait for it
    pinned: bool = False  # soft pin: evicted only when nothing else can go (until pin_until)
    pin_until: float = math.inf  # a soft pin's end (Mooncake's soft_pin_ttl_ms)
    hard_pinned: bool = False  # never evicted (removed only by a remove)
    score: float = 0.0  # access frequency, decayed with time (see `heat`)
    last_access: float = 0.0
    cooldown_until: float = 0.0  # just promoted/offloaded: do not move it again before this
    checksum: int | None = None  # of the value, given by the client at put_end
    put_id: int = 0  # the capability put_start hands out: put_end and put_revoke need it
    owner: str = ""  # the client that started the put (its unfinished bytes count against it)
    pending: int = 0  # bytes of this unfinished put counted against its owner
    extra: dict = field(default_factory=dict)

    def leased(self, now: float) -> bool:
        return self.lease_until > now

    def soft_pinned(self, now: float) -> bool:
        return self.pinned and self.pin_until > now

    def touch(self, now: float, half_life: float) -> None:
        """Count an access: the decayed frequency gains 1 (recency and frequency in one)."""
        self.score = self.heat(now, half_life) + 1.0
        self.last_access = now

    def eviction_order(self, now: float, half_life: float) -> tuple:
        """The one order in which objects leave a tier (DRAM evictions, SSD drops), coldest
        first: soft-pinned ones last, then by decayed access frequency, then least recent."""
        return (self.soft_pinned(now), self.heat(now, half_life), self.last_access)

    def heat(self, now: float, half_life: float) -> float:
        """The access count with each access weighing ``2 ** -(age / half_life)``: a block read
        often stays hot across a long gap, one read once long ago goes cold (LRFU)."""
        age = max(0.0, now - self.last_access)
        return self.score * math.pow(2.0, -age / half_life) if half_life > 0 else self.score

    def replicas_on(self, tier: Tier) -> list[Replica]:
        return [r for r in self.replicas if r.tier is tier]

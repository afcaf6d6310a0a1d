"""Messages of the pool, typed: what the master tells clients about objects, and what it
tells its storage nodes.

``ObjectDesc`` / ``ReplicaDesc``: an object as the master describes it to a client (its size,
checksum, the read lease it granted, the put id of a started put) and each of its replicas
(node, segment, offset in it, tier, and the incarnation of the process that owns the segment,
so a client never reads or writes through a descriptor of a previous life of that node). On
the wire a mapping; the client decodes and checks it once, where the answer arrives.

``PutOptions``: how a client asks for a new object to be stored (upsert, preferred nodes,
pins).

``IndexDelta``: one change of a node's index of what its segments hold (the master pushes them
and heartbeats fetch them; a standby master rebuilds its table from the nodes' indexes). On
the wire a list ``[op, key, size, segment, offset, checksum]``, decoded and checked by the
node before it touches its index.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common.errors import BadRequestError, ProtocolError

OPS = ("add", "del")
TIERS = ("dram", "ssd")


@dataclass(frozen=True, slots=True)
class PutOptions:
    """How to store a new object (Mooncake's ``ReplicateConfig``, less what needs RDMA)."""

    upsert: bool = False  # replace an existing object (its readers keep the old one's bytes)
    preferred: tuple[str, ...] = ()  # node ids or segment names tried first
    soft_pin: bool = False  # evicted only when nothing else can go ...
    pin_ttl: float | None = None  # ... for this many seconds (None: as long as it lives)
    hard_pin: bool = False  # never evicted

    @classmethod
    def from_wire(cls, value: object) -> PutOptions:
        """From ``{"upsert", "preferred", "soft_pin", "pin_ttl", "hard_pin"}`` (all optional);
        ValueError for anything else."""
        if value is None:
            return cls()
        if not isinstance(value, dict) or set(value) - set(cls.__slots__):
            raise ValueError(f"put options are a map of {sorted(cls.__slots__)}")
        preferred = value.get("preferred") or ()
        if (
            not isinstance(preferred, list | tuple)
            or len(preferred) > 64
            or not all(isinstance(p, str) and 0 < len(p) <= 255 for p in preferred)
        ):
            raise ValueError("preferred must be a list of at most 64 node or segment names")
        ttl = value.get("pin_ttl")
        if ttl is not None and not (isinstance(ttl, int | float) and not isinstance(ttl, bool)
                                    and 0 < ttl <= 1e9):  # fmt: skip
            raise ValueError("pin_ttl must be a number of seconds > 0")
        flags = {k: value.get(k, False) for k in ("upsert", "soft_pin", "hard_pin")}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise ValueError("upsert, soft_pin and hard_pin are booleans")
        return cls(preferred=tuple(preferred), pin_ttl=ttl, **flags)

    def to_wire(self) -> dict:
        return {"upsert": self.upsert, "preferred": list(self.preferred),
                "soft_pin": self.soft_pin, "pin_ttl": self.pin_ttl, "hard_pin": self.hard_pin}  # fmt: skip


@dataclass(slots=True, frozen=True)
class ReplicaDesc:
    node: str
    segment: str  # DRAM: a transfer-engine segment; SSD: the node's tier id
    offset: int
    tier: str  # "dram" or "ssd"
    owner: str = ""  # the owning process's incarnation ("": not known, e.g. a node gone)

    def to_wire(self) -> dict:
        return {"node": self.node, "segment": self.segment, "offset": self.offset,
                "tier": self.tier, "owner": self.owner}  # fmt: skip

    @classmethod
    def from_wire(cls, w: object) -> ReplicaDesc:
        ok = isinstance(w, dict)
        if ok:
            node, seg, off, tier, owner = (w.get(k) for k in  # type: ignore[union-attr]
                                           ("node", "segment", "offset", "tier", "owner"))  # fmt: skip
            ok = (isinstance(node, str) and isinstance(seg, str) and _count(off)
                  and tier in TIERS and isinstance(owner, str | None))  # fmt: skip
        if not ok:
            raise ProtocolError(f"malformed replica descriptor {w!r:.200}")
        return cls(node, seg, off, tier, owner or "")


@dataclass(slots=True, frozen=True)
class ObjectDesc:
    key: str
    size: int
    replicas: tuple[ReplicaDesc, ...]
    checksum: int | None = None  # of the value (None: a put not ended yet)
    lease_ttl: float = 0.0  # the read lease this answer carries (0: none)
    put_id: int | None = None  # a started put's capability (put_start answers only)

    def to_wire(self) -> dict:
        out = {"key": self.key, "size": self.size, "checksum": self.checksum,
               "replicas": [r.to_wire() for r in self.replicas], "lease_ttl": self.lease_ttl}  # fmt: skip
        if self.put_id is not None:
            out["put_id"] = self.put_id
        return out

    @classmethod
    def from_wire(cls, w: object) -> ObjectDesc:
        """Decode an object description; ``ProtocolError`` for anything else."""
        ok = isinstance(w, dict)
        if ok:
            key, size, reps, checksum, ttl, put_id = (w.get(k) for k in (  # type: ignore[union-attr]
                "key", "size", "replicas", "checksum", "lease_ttl", "put_id"))  # fmt: skip
            ok = (isinstance(key, str) and _count(size) and isinstance(reps, list)
                  and (checksum is None or _count(checksum))
                  and (ttl is None or (isinstance(ttl, int | float) and ttl >= 0))
                  and (put_id is None or _count(put_id)))  # fmt: skip
        if not ok:
            raise ProtocolError(f"malformed object description {w!r:.200}")
        replicas = tuple(ReplicaDesc.from_wire(r) for r in reps)
        return cls(key, size, replicas, checksum, float(ttl or 0.0), put_id)

    @classmethod
    def maybe(cls, w: object) -> ObjectDesc | None:
        """``from_wire``, or None for a missing object (a None entry of a batch answer)."""
        return None if w is None else cls.from_wire(w)


@dataclass(slots=True, frozen=True)
class IndexDelta:
    op: str  # "add": the segment range now holds this object; "del": it no longer does
    key: str
    size: int
    segment: str
    offset: int
    checksum: int | None = None  # of the object ("add"), None for "del"

    @classmethod
    def add(cls, key: str, size: int, segment: str, offset: int, checksum: int | None):
        return cls("add", key, size, segment, offset, checksum)

    @classmethod
    def delete(cls, key: str, segment: str, offset: int):
        return cls("del", key, 0, segment, offset, None)

    def to_wire(self) -> list:
        return [self.op, self.key, self.size, self.segment, self.offset, self.checksum]

    @classmethod
    def from_wire(cls, w: object) -> IndexDelta:
        """Decode one entry; ``BadRequestError`` for anything but a well-formed delta."""
        ok = isinstance(w, list) and len(w) == 6
        if ok:
            op, key, size, segment, offset, checksum = w  # type: ignore[misc]
            ok = (op in OPS and isinstance(key, str) and isinstance(segment, str)
                  and _count(size) and _count(offset)
                  and (checksum is None or _count(checksum)))  # fmt: skip
        if not ok:
            raise BadRequestError("deltas: each entry is [op (add|del), key, size, segment, "
                                  f"offset, checksum], got {w!r:.200}")  # fmt: skip
        return cls(op, key, size, segment, offset, checksum)


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0

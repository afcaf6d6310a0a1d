"""Messages between the pool's master and its storage nodes, typed.

``IndexDelta``: one change of a node's index of what its segments hold (the master pushes them
and heartbeats fetch them; a standby master rebuilds its table from the nodes' indexes). On
the wire a list ``[op, key, size, segment, offset, checksum]``, decoded and checked by the
node before it touches its index.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common.errors import BadRequestError

OPS = ("add", "del")


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

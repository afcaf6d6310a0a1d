"""A node's own prefix cache: block hashes in LRU order, with the change log the conductor
reads at its polls (a worker's KV events: ``stored`` / ``removed``).

A request's chain is touched tail first, so that its head is the most recently used: under
pressure a chain loses its last blocks first and its prefix stays usable (the order in which
vLLM and kvpool's block pool free a request's blocks).
"""

from __future__ import annotations

from collections import OrderedDict


class LocalCache:
    __slots__ = ("blocks", "capacity", "evictions", "log", "view")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("a cache capacity must be >= 0 blocks")
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.log: list[tuple[bool, bytes]] = []  # (stored, hash) since the last poll
        self.view: set[bytes] = set()  # the cached set as the conductor last saw it
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, h: bytes) -> bool:
        return h in self.blocks

    def prefix(self, hashes: tuple[bytes, ...]) -> int:
        """Leading blocks of ``hashes`` held now."""
        n, blocks = 0, self.blocks
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def touch(self, hashes: tuple[bytes, ...]) -> None:
        """A hit on these blocks (held ones): most recently used, the head last."""
        blocks = self.blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)

    def insert(self, hashes: tuple[bytes, ...]) -> None:
        """The chain is computed (or loaded): held, most recently used, then evict the least
        recently used blocks beyond the capacity."""
        if not self.capacity:
            return
        blocks, log = self.blocks, self.log
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                log.append((True, h))
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            log.append((False, h))
            self.evictions += 1

    def sync_view(self) -> None:
        """The conductor polls: it learns every change since its last poll."""
        view = self.view
        for stored, h in self.log:
            if stored:
                view.add(h)
            else:
                view.discard(h)
        self.log.clear()

"""Best-fit offset allocator for one registered segment (the master's view, never the bytes).

A storage node registers a segment (a DRAM region, an SSD tier's budget); the master hands out
byte ranges of it with :class:`OffsetAllocator` and the node writes the bytes there.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort


class OffsetAllocator:
    """Best-fit allocator of aligned byte ranges in ``[0, capacity)`` with immediate coalescing.

    Free ranges are indexed by ``start -> size`` and ``end -> start`` dicts (O(1) neighbour
    lookup when coalescing), a sorted list of starts (``reserve`` finds the containing range)
    and a sorted list of ``(size, start)`` (best fit: the smallest fitting range, lowest offset
    on ties). ``allocate``, ``free`` and ``reserve`` are O(log f) searches plus O(f) list
    shifts (a memmove, cheap at the thousands of free ranges a segment holds), f = number of
    free ranges; the properties are O(1); ``restore`` rebuilds in O(n log n).

    Sizes are rounded up to ``alignment``, so every offset is aligned. ``capacity`` need not
    be: the free range ending at it may then be shorter than an aligned size that would fit.
    Not thread-safe: the master serializes access.
    """

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self._capacity = capacity
        self._alignment = alignment
        self._free_by_start: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._free_starts: list[int] = []
        self._free_by_size: list[tuple[int, int]] = []
        self._allocated: dict[int, int] = {}
        self._used = 0
        self._free_bytes = 0
        self._add_free(0, capacity)

    # -- properties -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used(self) -> int:
        """Bytes held by live allocations (rounded sizes)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    @property
    def largest_free(self) -> int:
        """Length of the largest free range (the largest size that can be allocated now)."""
        return self._free_by_size[-1][0] if self._free_by_size else 0

    @property
    def num_allocations(self) -> int:
        return len(self._allocated)

    def fragmentation(self) -> float:
        """``1 - largest_free / free_bytes``: 0 when all free space is one range (or none)."""
        if self._free_bytes == 0:
            return 0.0
        return 1.0 - self.largest_free / self._free_bytes

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges as ``(offset, size)``, sorted by offset (for tests and stats)."""
        return [(s, self._free_by_start[s]) for s in self._free_starts]

    def allocated_size(self, offset: int) -> int:
        """The (rounded) size of the live allocation starting at ``offset``; KeyError if none."""
        try:
            return self._allocated[offset]
        except KeyError:
            raise KeyError(f"no allocation starts at offset {offset}") from None

    # -- operations -------------------------------------------------------------------------

    def allocate(self, size: int) -> int | None:
        """Offset of a new range of ``size`` bytes (rounded up), or None if no free range fits."""
        rounded = self._round(size)
        i = bisect_left(self._free_by_size, (rounded, -1))
        if i == len(self._free_by_size):
            return None
        hole_size, start = self._free_by_size[i]
        self._remove_free(start, hole_size, index=i)
        if hole_size > rounded:
            self._add_free(start + rounded, hole_size - rounded)
        self._allocated[start] = rounded
        self._used += rounded
        return start

    def free(self, offset: int) -> None:
        """Return the range starting at ``offset``; KeyError if it is not a live allocation."""
        size = self._allocated.pop(offset, None)
        if size is None:
            raise KeyError(f"offset {offset} is not the start of a live allocation")
        self._used -= size
        start, end = offset, offset + size
        left = self._free_by_end.get(start)
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        right_size = self._free_by_start.get(end)
        if right_size is not None:
            self._remove_free(end, right_size)
            end += right_size
        self._add_free(start, end - start)

    def reserve(self, offset: int, size: int) -> None:
        """Mark ``[offset, offset + size)`` allocated (a node reports it holds it).

        Raises ValueError if the range is misaligned, out of bounds or overlaps a live one.
        """
        rounded = self._checked_range(offset, size)
        i = bisect_right(self._free_starts, offset) - 1
        hole_start = self._free_starts[i] if i >= 0 else -1
        hole_size = self._free_by_start.get(hole_start, 0)
        if offset + rounded > hole_start + hole_size:  # hole_start <= offset by the bisect
            raise ValueError(f"range ({offset}, {rounded}) overlaps a live allocation")
        self._remove_free(hole_start, hole_size)
        if offset > hole_start:
            self._add_free(hole_start, offset - hole_start)
        if offset + rounded < hole_start + hole_size:
            self._add_free(offset + rounded, hole_start + hole_size - offset - rounded)
        self._allocated[offset] = rounded
        self._used += rounded

    def snapshot(self) -> list[tuple[int, int]]:
        """The live allocations as ``(offset, size)``, sorted by offset."""
        return sorted(self._allocated.items())

    @classmethod
    def restore(
        cls, capacity: int, allocations: list[tuple[int, int]], alignment: int = 64
    ) -> OffsetAllocator:
        """A fresh allocator holding ``allocations``; ValueError on overlap or bad ranges."""
        alloc = cls(capacity, alignment)
        alloc._remove_free(0, capacity)
        cursor = 0
        for offset, size in sorted(allocations):
            rounded = alloc._checked_range(offset, size)
            if offset < cursor:
                raise ValueError(f"range ({offset}, {rounded}) overlaps the previous one")
            if offset > cursor:
                alloc._add_free(cursor, offset - cursor)
            alloc._allocated[offset] = rounded
            alloc._used += rounded
            cursor = offset + rounded
        if cursor < capacity:
            alloc._add_free(cursor, capacity - cursor)
        return alloc

    # -- internals --------------------------------------------------------------------------

    def _round(self, size: int) -> int:
        rounded = -(-size // self._alignment) * self._alignment
        if size <= 0 or rounded > self._capacity:
            raise ValueError(f"size {size} can never fit in capacity {self._capacity}")
        return rounded

    def _checked_range(self, offset: int, size: int) -> int:
        rounded = self._round(size)
        if offset < 0 or offset % self._alignment or offset + rounded > self._capacity:
            raise ValueError(f"range ({offset}, {rounded}) is misaligned or out of bounds")
        return rounded

    def _add_free(self, start: int, size: int) -> None:
        self._free_by_start[start] = size
        self._free_by_end[start + size] = start
        insort(self._free_starts, start)
        insort(self._free_by_size, (size, start))
        self._free_bytes += size

    def _remove_free(self, start: int, size: int, index: int | None = None) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + size]
        del self._free_starts[bisect_left(self._free_starts, start)]
        if index is None:
            index = bisect_left(self._free_by_size, (size, start))
        assert self._free_by_size[index] == (size, start)
        del self._free_by_size[index]
        self._free_bytes -= size

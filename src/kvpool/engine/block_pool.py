"""The block pool: KV blocks, reference counts, the hash -> block map and LRU reuse.

Block 0 is reserved as the padding block (block tables are padded with it) and is never
handed out. A freed block keeps its hash and contents until it is reused, so a later request
with the same prefix can still hit it; free blocks are reused least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

MAX_EVENTS = 65536  # block events kept for pollers (the conductor); older ones need a snapshot


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


@dataclass(slots=True)
class BlockPoolStats:
    evictions: int = 0  # cached blocks whose content was dropped for reuse
    hash_collisions: int = 0  # hash hits whose tokens did not match


class BlockEvent(NamedTuple):
    """A change of the cache's contents, as vLLM's KV events: a hash became (un)servable."""

    seq: int
    kind: str  # "stored" | "removed"
    block_hash: bytes


class BlockPool:
    """Owns ``num_blocks`` block descriptors (the bytes live in the engine's KV tensor)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (block 0 is padding)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[0].ref_cnt = 1  # padding block, pinned forever
        # Free blocks in reuse order: head is reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[bytes, KVBlock] = {}
        self.stats = BlockPoolStats()
        self.events: deque[BlockEvent] = deque(maxlen=MAX_EVENTS)
        self.event_seq = 0  # seq of the newest event

    def _event(self, kind: str, block_hash: bytes) -> None:
        self.event_seq += 1
        self.events.append(BlockEvent(self.event_seq, kind, block_hash))

    def events_since(self, seq: int) -> list[BlockEvent] | None:
        """Events after ``seq``, or None if some were already dropped (take a snapshot)."""
        if seq >= self.event_seq:
            return []
        events = list(self.events)  # one C-level copy: safe while the engine thread appends
        if not events or events[0].seq > seq + 1:
            return None
        return [e for e in events if e.seq > seq]

    def cached_hashes(self) -> list[bytes]:
        """Every hash the cache can serve now (the snapshot behind the events)."""
        return list(self._cached)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """Share of usable blocks held by running requests (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block with this hash *and* these tokens, or None (a mismatch is a miss)."""
        if not self.enable_caching:
            return None
        block = self._cached.get(block_hash)
        if block is None:
            return None
        if block.token_ids != token_ids:
            self.stats.hash_collisions += 1
            return None
        return block

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on each block (taking it off the free list if it was free)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock] | None:
        """``n`` fresh blocks with one reference each, or None if fewer are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._drop_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; pass them tail first so tails are reused first."""
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    # Uncached blocks are worthless: reuse them before cached ones.
                    self._free[b.block_id] = None
                    self._free.move_to_end(b.block_id, last=False)
                else:
                    self._free[b.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Register a full block under its hash. False if that hash is already served."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block
        self._event("stored", block_hash)
        return True

    def uncache(self, block: KVBlock) -> None:
        """Drop a block's hash (its contents are not what the hash promises)."""
        self._drop_hash(block, evicted=False)

    def reset_cache(self) -> int:
        """Forget every cached hash of free blocks; returns how many were dropped."""
        n = 0
        for block_id in self._free:
            if self.blocks[block_id].block_hash is not None:
                self._drop_hash(self.blocks[block_id], evicted=False)
                n += 1
        return n

    def _drop_hash(self, block: KVBlock, evicted: bool = True) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self._event("removed", block.block_hash)
        block.block_hash = None
        block.token_ids = None
        if evicted:
            self.stats.evictions += 1

"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, caching full blocks, and
the blocks the sequences of one request share (``fork``; copy-on-write of a shared partial
block when a sequence is about to write into it)."""

from __future__ import annotations

from typing import NamedTuple

from kvpool.common.hashing import block_hashes
from kvpool.engine.block_pool import BlockPool, KVBlock
from kvpool.engine.connectors.base import BlockRef
from kvpool.engine.request import Request


class PrefixHit(NamedTuple):
    blocks: list[KVBlock]  # cached blocks of the prompt prefix, in order
    num_tokens: int


class KVCacheManager:
    """Request-level view on the block pool."""

    def __init__(self, pool: BlockPool, block_size: int, hash_seed: bytes) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks already offered to the cache
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies the next step must make

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, req: Request, upto_tokens: int) -> None:
        """Extend ``req.block_hashes`` over the full blocks among its first ``upto_tokens``."""
        have = len(req.block_hashes)
        if (upto_tokens // self.block_size) <= have:
            return
        parent = req.block_hashes[-1] if have else None
        req.block_hashes.extend(
            block_hashes(
                req.token_ids[:upto_tokens],
                self.block_size,
                self.hash_seed,
                start=have,
                parent=parent,
            )
        )

    def find_prefix(self, req: Request) -> PrefixHit:
        """Longest chain of cached, token-verified blocks; always leaves >= 1 token to compute."""
        self.update_hashes(req, req.num_tokens)
        max_blocks = (req.num_tokens - 1) // self.block_size
        out: list[KVBlock] = []
        bs = self.block_size
        for i, h in enumerate(req.block_hashes[:max_blocks]):
            block = self.pool.lookup(h, tuple(req.token_ids[i * bs : (i + 1) * bs]))
            if block is None:
                break
            out.append(block)
        return PrefixHit(out, len(out) * bs)

    def allocate(
        self,
        req: Request,
        num_new_tokens: int,
        prefix: list[KVBlock] | None = None,
        num_external: int = 0,
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``req`` (after its computed ones).

        ``prefix`` are cache hits to adopt first (only when the request has no blocks yet).
        Returns the newly allocated blocks, or None (and changes nothing) if the pool is short.
        """
        have = self._blocks.setdefault(req.request_id, [])
        prefix = prefix or []
        # Prefix hits that sit on the free list cost a free block each.
        free_hits = sum(1 for b in prefix if b.ref_cnt == 0)
        base = len(prefix) * self.block_size if prefix else req.num_computed_tokens
        total_tokens = base + num_external + num_new_tokens
        shared = None if prefix else self._shared_tail(req, have)
        need = self.blocks_needed(total_tokens) - len(have) - len(prefix) + (shared is not None)
        if need > 0 and need + free_hits > self.pool.num_free_blocks:
            return None
        if prefix:
            assert not have
            self.pool.touch(prefix)
            have.extend(prefix)
        new = self.pool.allocate(need) if need > 0 else []
        assert new is not None
        if shared is not None:  # copy-on-write: this sequence gets its own copy to write into
            i, src = shared
            have[i] = new[0]
            self.copies.append((src.block_id, new[0].block_id))
            self.pool.free([src])
            have.extend(new[1:])
        else:
            have.extend(new)
        req.block_ids = [b.block_id for b in have]
        return new

    def _shared_tail(self, req: Request, have: list[KVBlock]) -> tuple[int, KVBlock] | None:
        """The partly computed block ``req`` writes into next, if other sequences share it
        (full blocks are never written again, so only this one can need a copy)."""
        pos = req.num_computed_tokens
        i = pos // self.block_size
        if pos % self.block_size == 0 or i >= len(have) or have[i].ref_cnt < 2:
            return None
        return i, have[i]

    def fork(self, parent: Request, child: Request) -> None:
        """``child`` shares every block of ``parent`` (one more reference each): the full ones
        for good, a partial last one until either of them writes into it (``allocate``)."""
        blocks = self._blocks.get(parent.request_id, [])
        assert child.request_id not in self._blocks
        self.pool.touch(blocks)
        self._blocks[child.request_id] = list(blocks)
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)
        child.block_ids = list(parent.block_ids)

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies the step being scheduled must make before it writes any KV."""
        out, self.copies = self.copies, []
        return out

    def cache_full_blocks(self, req: Request, num_tokens: int | None = None) -> list[BlockRef]:
        """Register the full blocks among ``req``'s first ``num_tokens`` tokens (default: its
        computed ones); return the newly registered ones.

        The scheduler registers a chunk's blocks when it schedules the chunk, before they are
        computed: every write of a step's KV precedes every read of it (per layer), so another
        request scheduled in the same step can already share them, as in vLLM. If the step
        fails, the engine must :meth:`forget` them.
        """
        have = self._blocks.get(req.request_id, [])
        if num_tokens is None:
            num_tokens = req.num_computed_tokens
        num_full = num_tokens // self.block_size
        first = self._num_registered.get(req.request_id, 0)
        if num_full <= first:
            return []
        self.update_hashes(req, num_full * self.block_size)
        self._num_registered[req.request_id] = num_full
        out = []
        bs = self.block_size
        for i in range(first, num_full):
            block = have[i]
            if block.block_hash is not None:
                continue
            toks = tuple(req.token_ids[i * bs : (i + 1) * bs])
            if self.pool.cache_block(block, req.block_hashes[i], toks):
                out.append(BlockRef(block.block_id, req.block_hashes[i], toks))
        return out

    def forget(self, refs: list[BlockRef]) -> None:
        """Unregister blocks whose KV was never computed (a failed step)."""
        for r in refs:
            self.pool.uncache(self.pool.blocks[r.block_id])
        self._num_registered.clear()

    def get_blocks(self, req: Request) -> list[KVBlock]:
        return self._blocks.get(req.request_id, [])

    def detach(self, req: Request) -> list[KVBlock]:
        """Take ``req``'s blocks out of its table without freeing them (a load may still be
        writing into them); hand them to :meth:`release` once it has stopped."""
        blocks = self._blocks.pop(req.request_id, [])
        self._num_registered.pop(req.request_id, None)
        req.block_ids = []
        return blocks

    def release(self, blocks: list[KVBlock]) -> None:
        """Free blocks taken out by :meth:`detach`."""
        self.pool.free(list(reversed(blocks)))

    def free(self, req: Request) -> None:
        """Release every block of ``req`` (tail first, so tails are evicted before heads)."""
        blocks = self._blocks.pop(req.request_id, [])
        self._num_registered.pop(req.request_id, None)
        if self.copies:  # a copy into a block given back is not needed any more
            gone = {b.block_id for b in blocks if b.ref_cnt == 1}
            self.copies = [c for c in self.copies if c[1] not in gone]
        self.pool.free(list(reversed(blocks)))
        req.block_ids = []

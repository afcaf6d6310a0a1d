"""One engine's KV blocks as pool objects (``protocol/kv_object.py``).

Key ``kv/<chain hash hex>``; the object is a header with the block's token ids, then the
block's slice of the KV tensor. Reads and writes move the payload straight between the KV
tensor and the pool's segments (the header travels as a second part of the same object): no
staging copy. A block read back counts only if its size is right and its header holds the
request's token ids. Errors (``KVPoolError``) go to the caller, which decides what a failing
pool means (``store.py``).
"""

from __future__ import annotations

import numpy as np

from kvpool.common.errors import AlreadyExistsError
from kvpool.engine.connectors.base import BlockRef
from kvpool.protocol.kv_object import block_key, header_size, header_tokens, pack_header


class PoolBlocks:
    """Reads and writes the blocks of one KV tensor (``blocks``: its [num_blocks, bytes]
    uint8 view) as pool objects through ``client`` (a ``StoreClient``)."""

    def __init__(self, client, blocks: np.ndarray, block_size: int) -> None:
        self.client = client
        self.blocks = blocks
        self.block_size = block_size
        self.head_len = header_size(block_size)

    @property
    def block_bytes(self) -> int:
        return self.blocks.shape[1]

    def header(self, ref: BlockRef) -> bytes:
        return pack_header(ref.token_ids, self.block_size, self.block_bytes)

    def tokens(self, head: bytearray) -> tuple[int, ...] | None:
        return header_tokens(head, self.block_size, self.block_bytes)

    def checksum(self, block_hash: bytes, parts: list) -> int:
        return self.client.io.checksum(block_key(block_hash), parts)

    def read(self, refs: list[BlockRef], block_ids: list[int]) -> tuple[int, int]:
        """Fill ``block_ids`` with ``refs``' objects: (how many leading blocks arrived whole,
        with the expected token ids; whether a block of the right size held other tokens)."""
        heads = [bytearray(self.head_len) for _ in refs]
        parts = [[h, self.blocks[b]] for h, b in zip(heads, block_ids, strict=True)]
        sizes = self.client.batch_get_into_parts([block_key(r.block_hash) for r in refs], parts)
        want = self.head_len + self.block_bytes
        for n, (ref, head, size) in enumerate(zip(refs, heads, sizes, strict=True)):
            if size != want or self.tokens(head) != ref.token_ids:
                return n, int(size == want)
        return len(refs), 0

    def write(self, refs: list[BlockRef]) -> list[tuple[BlockRef, list]]:
        """Put ``refs``' blocks; the ones the pool now holds (written, or there already), each
        with the parts it was written from."""
        keys = [block_key(r.block_hash) for r in refs]
        parts = [[self.header(r), self.blocks[r.block_id]] for r in refs]
        results = self.client.batch_put_parts(keys, parts)
        return [(r, ps) for r, ps, x in zip(refs, parts, results, strict=True)
                if x is None or isinstance(x, AlreadyExistsError)]  # fmt: skip

    def probe(self, hashes: list[bytes]) -> int:
        """Read blocks into scratch memory (to measure the pool); how many read whole."""
        scratch = np.empty((len(hashes), self.head_len + self.block_bytes), dtype=np.uint8)
        sizes = self.client.batch_get_into([block_key(h) for h in hashes], list(scratch))
        return sum(1 for size in sizes if size == scratch.shape[1])

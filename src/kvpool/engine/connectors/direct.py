"""Direct prefill-to-decode reads: KV blocks read straight from the engine that computed them.

The prefill side registers its whole KV tensor as a transfer segment (block-major: block ``b``
is the byte range ``[b * block_bytes, (b + 1) * block_bytes)``) and remembers, for every block
it saved to the pool, where it was and the checksum the pool got for it. A prefill result then
carries a ``KVHandle`` (``protocol/decode.py``) for its prompt.

The decode side reads the handle's blocks with one batch of transfer READs into its own KV
tensor (one copy, no master round trip) and checks each block against the checksum (the same
integrity function the pool uses, over the block's object: header and payload). The prefill
engine may have reused a block since, or died: a block that does not check out, and every one
after it, is read from the pool instead.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from kvpool.common.errors import KVPoolError
from kvpool.engine.connectors.base import BlockRef
from kvpool.protocol.decode import HandleBlock, KVHandle
from kvpool.transfer import Op, TransferRequest

logger = logging.getLogger(__name__)

MAX_PUBLISHED = 1 << 16  # blocks remembered for handles (the most recent saves)


class DirectReads:
    """Both sides: ``publish`` + ``record`` + ``handle`` (prefill), ``usable`` + ``read``
    (decode). ``checksum(block_hash, parts)``: the pool's integrity check of a block object."""

    def __init__(self, engine, kv: np.ndarray, checksum: Callable[[bytes, list], int],
                 header: Callable[[BlockRef], bytes], timeout: float = 5.0) -> None:  # fmt: skip
        self.engine = engine  # the connector's transfer engine (its StoreClient's)
        self.kv = kv  # [num_blocks, block_bytes] uint8, the engine's KV tensor
        self.block_bytes = kv.shape[1]
        self._checksum = checksum
        self._header = header
        self.timeout = timeout
        self.segment: str | None = None
        self._published: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.read_blocks = 0  # blocks read directly and verified
        self.read_bytes = 0
        self.fallbacks = 0  # reads that stopped short (a reused block, a dead peer)
        self._s_per_byte = 1e-9  # measured read speed (EWMA); 1 GB/s before any read

    # -- prefill side -------------------------------------------------------------------------

    def publish(self) -> str:
        """Register the KV tensor (reachable over TCP); its segment name."""
        name = f"kv-{uuid.uuid4().hex[:16]}"
        self.engine.register(name, self.kv)
        self.segment = name
        return name

    def record(self, refs: list[BlockRef], checksums: list[int]) -> None:
        """These blocks were saved with these checksums (from the save thread)."""
        with self._lock:
            for ref, c in zip(refs, checksums, strict=True):
                self._published[ref.block_hash] = (ref.block_id, c)
                self._published.move_to_end(ref.block_hash)
            while len(self._published) > MAX_PUBLISHED:
                self._published.popitem(last=False)

    def handle(self, hashes: list[bytes]) -> KVHandle | None:
        """A handle for the leading blocks of a prompt (chain ``hashes``) that were saved."""
        if self.segment is None:
            return None
        blocks = []
        with self._lock:
            for i, h in enumerate(hashes):
                entry = self._published.get(h)
                if entry is None:
                    break
                blocks.append(HandleBlock(i, entry[0], h, entry[1]))
        if not blocks:
            return None
        return KVHandle(self.segment, self.engine.owner_id, self.block_bytes, tuple(blocks))

    # -- decode side --------------------------------------------------------------------------

    def predict_s(self, n_blocks: int) -> float:
        """Seconds a direct read of ``n_blocks`` is expected to take (measured)."""
        return n_blocks * self.block_bytes * self._s_per_byte

    def usable(self, handle: object, hashes: list[bytes], start: int) -> int:
        """How many blocks from index ``start`` of a chain the handle holds (same hashes)."""
        if not isinstance(handle, KVHandle) or handle.block_bytes != self.block_bytes:
            return 0
        by_index = handle.by_index()
        n = 0
        for i in range(start, len(hashes)):
            b = by_index.get(i)
            if b is None or b.block_hash != hashes[i]:
                break
            n += 1
        return n

    def read(self, handle: KVHandle, blocks: list[BlockRef], block_ids: list[int],
             timeout: float | None = None) -> int:  # fmt: skip
        """Read ``blocks`` (prompt blocks the handle holds) into ``block_ids``; how many leading
        ones arrived and verified."""
        src = {b.block_hash: b for b in handle.blocks}
        picks = [src.get(r.block_hash) for r in blocks]
        n_ask = next((i for i, b in enumerate(picks) if b is None), len(picks))
        if not n_ask:
            return 0
        reqs = [TransferRequest(Op.READ, self.kv[dst], handle.segment,
                                picks[i].block_id * self.block_bytes)  # type: ignore[union-attr]
                for i, dst in enumerate(block_ids[:n_ask])]  # fmt: skip
        t0 = time.perf_counter()
        try:
            self.engine.expect_owner(handle.segment, handle.owner)
            statuses = self.engine.transfer_statuses(reqs, timeout or self.timeout)
            took = time.perf_counter() - t0
            self._s_per_byte = 0.7 * self._s_per_byte + 0.3 * took / (n_ask * self.block_bytes)
        except KVPoolError as exc:  # the segment is gone (its worker died) or unreachable
            logger.info("direct KV read from %s failed (%s); reading from the pool",
                        handle.segment, exc)  # fmt: skip
            self.fallbacks += 1
            return 0
        n = 0
        for i, (ref, status) in enumerate(zip(blocks[:n_ask], statuses, strict=True)):
            if status is None or not status.ok:
                break
            parts = [self._header(ref), self.kv[block_ids[i]]]
            if self._checksum(ref.block_hash, parts) != picks[i].checksum:  # type: ignore[union-attr]
                break  # reused (or torn) since the prefill: this one and the rest from the pool
            n += 1
        if n < len(blocks):
            self.fallbacks += 1
        self.read_blocks += n
        self.read_bytes += n * self.block_bytes
        return n

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
from kvpool.protocol.decode import HandleBlock, HandleTail, KVHandle
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
        self._want_tail: set[str] = set()  # hand-off prefills still running
        self._tails: dict[str, HandleTail] = {}  # their recorded partial blocks, until taken
        self._lock = threading.Lock()
        self.read_blocks = 0  # blocks read directly and verified
        self.read_bytes = 0
        self.fallbacks = 0  # reads that stopped short (a reused block, a dead peer)
        self.tail_reads = 0  # partial last blocks read and verified
        self.tail_misses = 0  # partial blocks that did not arrive or check out (computed)
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

    def handle(self, hashes: list[bytes], tail: HandleTail | None = None) -> KVHandle | None:
        """A handle for the leading blocks of a prompt (chain ``hashes``) that were saved,
        and its partial last block (``take_tail``; the decode side uses it once it has the
        full blocks before it, from wherever: its own cache, the pool, this handle)."""
        if self.segment is None:
            return None
        blocks = []
        with self._lock:
            for i, h in enumerate(hashes):
                entry = self._published.get(h)
                if entry is None:
                    break
                blocks.append(HandleBlock(i, entry[0], h, entry[1]))
        if not blocks and tail is None:
            return None
        return KVHandle(self.segment, self.engine.owner_id, self.block_bytes, tuple(blocks),
                        tail)  # fmt: skip

    def expect_tail(self, request_id: str) -> None:
        """``request_id`` is a hand-off prefill: record its partial last block when it ends."""
        with self._lock:
            self._want_tail.add(request_id)

    def capture_tail(self, req, block_size: int) -> None:
        """On the engine thread, as ``req`` finishes and before its blocks are freed: if it is
        an expected hand-off with a partial last prompt block, record that block."""
        rid = req.request_id
        with self._lock:
            if rid not in self._want_tail:
                return
            self._want_tail.discard(rid)
        index, tokens = divmod(req.num_prompt_tokens, block_size)
        if not tokens or self.segment is None or index >= len(req.block_ids) or \
                index > len(req.block_hashes):  # fmt: skip
            return
        block_id = req.block_ids[index]
        ref = BlockRef(block_id, tail_key(req.block_hashes[:index]),
                       tuple(req.token_ids[index * block_size : req.num_prompt_tokens]))  # fmt: skip
        checksum = self._checksum(ref.block_hash, [self._header(ref), self.kv[block_id]])
        with self._lock:
            self._tails[rid] = HandleTail(index, block_id, tokens, checksum)

    def take_tail(self, request_id: str) -> HandleTail | None:
        """The partial block recorded for ``request_id`` (once), and forget it was expected."""
        with self._lock:
            self._want_tail.discard(request_id)
            return self._tails.pop(request_id, None)

    # -- decode side --------------------------------------------------------------------------

    def load_tail(self, request, computed: int, block_id: int, block_size: int,
                  timeout: float | None = None) -> int:  # fmt: skip
        """The prompt tokens of ``request``'s partial last block read into ``block_id`` from
        its handle (0: none, not this prompt's, or it did not check out)."""
        handle = getattr(request, "kv_handle", None)
        t = handle.tail if isinstance(handle, KVHandle) else None
        if t is None or t.index * block_size != computed or t.tokens >= block_size or \
                computed + t.tokens >= request.num_tokens or \
                len(request.block_hashes) < t.index:  # fmt: skip
            return 0  # not this prompt's partial block (or not one at all: a bad handle)
        tokens = tuple(request.token_ids[computed : computed + t.tokens])
        ok = self.read_tail(handle, request.block_hashes[: t.index], tokens, block_id, timeout)
        return t.tokens if ok else 0

    def read_tail(self, handle: KVHandle, hashes: list[bytes], tokens: tuple[int, ...],
                  block_id: int, timeout: float | None = None) -> bool:  # fmt: skip
        """Read the handle's partial block into ``block_id`` and check it against this
        prompt: the chain ``hashes`` of the full blocks before it and its ``tokens``."""
        t = handle.tail
        if t is None or handle.block_bytes != self.block_bytes or t.index != len(hashes) or \
                t.tokens != len(tokens):  # fmt: skip
            return False
        ref = BlockRef(block_id, tail_key(hashes), tokens)
        req = TransferRequest(Op.READ, self.kv[block_id], handle.segment,
                              t.block_id * self.block_bytes)  # fmt: skip
        try:
            self.engine.expect_owner(handle.segment, handle.owner)
            (status,) = self.engine.transfer_statuses([req], timeout or self.timeout)
        except KVPoolError as exc:
            logger.info("direct read of a partial block from %s failed (%s); computing it",
                        handle.segment, exc)  # fmt: skip
            self.tail_misses += 1
            return False
        if status is None or not status.ok or \
                self._checksum(ref.block_hash, [self._header(ref), self.kv[block_id]]) != t.checksum:  # fmt: skip
            self.tail_misses += 1  # reused since the prefill (or torn): compute it
            return False
        self.tail_reads += 1
        self.read_bytes += self.block_bytes
        return True

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


def tail_key(hashes: list[bytes]) -> bytes:
    """What a partial block's checksum is keyed by: the chain hash of the full blocks before
    it (so it checks out only under the same prefix), marked as a tail."""
    return (hashes[-1] if hashes else b"") + b"/tail"

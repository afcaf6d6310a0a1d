"""The store client's data path: bytes to and from replicas through the transfer engine, and
the check that what was read is what was put (xxh3-64 in an open cluster, a keyed BLAKE3 MAC
of key and value with a token: see ``store/integrity.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvpool.common.errors import BadRequestError, KVPoolError, NotFoundError, TransferError
from kvpool.protocol.store import ObjectDesc, ReplicaDesc
from kvpool.store.integrity import checksum_parts
from kvpool.transfer import Op, TransferEngine, TransferRequest

logger = logging.getLogger("kvpool.store.client")


def requests(op: Op, parts: list, replica: ReplicaDesc,
             engine: TransferEngine) -> list[TransferRequest]:  # fmt: skip
    """One request per non-empty part, at consecutive offsets of the replica (``engine``
    forgets a cached descriptor of its segment that another owner published: a node that
    restarted)."""
    if replica.owner:
        engine.expect_owner(replica.segment, replica.owner)
    out, off = [], replica.offset
    for p in parts:
        if len(p):  # an empty part (a header-only value's data, say) moves nothing
            out.append(TransferRequest(op, p, replica.segment, off))
            off += len(p)
    return out


class ReplicaIO:
    """Writes a value to every replica; reads it from the first one that yields the right
    bytes. ``mac_key``: the cluster's MAC key (None: plain checksums)."""

    def __init__(self, engine: TransferEngine, timeout: float, mac_key: bytes | None,
                 on_unreachable: Callable[[list[str]], None] | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.timeout = timeout
        self._mac_key = mac_key
        self._on_unreachable = on_unreachable  # told the nodes a read could not reach

    def checksum(self, key: str, parts: list) -> int:
        return checksum_parts(parts, key, self._mac_key)

    def verified(self, meta: ObjectDesc, parts: list) -> bool:
        want = meta.checksum
        return want is not None and self.checksum(meta.key, parts) == want

    def write(self, meta: ObjectDesc, parts: list) -> None:
        """``parts`` (concatenated) into every replica of a started put; raises on failure."""
        reqs = [q for r in meta.replicas for q in requests(Op.WRITE, parts, r, self.engine)]
        self.engine.transfer(reqs, timeout=self.timeout)

    def read(self, meta: ObjectDesc, parts: list) -> None:
        """The value into ``parts`` from the first replica that reads and verifies;
        ``NotFoundError`` when none does."""
        last: Exception | None = None
        unreachable = []
        for r in meta.replicas:
            try:
                self.engine.transfer(requests(Op.READ, parts, r, self.engine), self.timeout)
            except KVPoolError as exc:
                last = exc
                unreachable.append(r.node)
                continue
            if self.verified(meta, parts):
                return
            last = TransferError(f"checksum mismatch reading {meta.key} from {r.node}")
        if unreachable and self._on_unreachable is not None:
            self._on_unreachable(unreachable)
        raise NotFoundError(f"key {meta.key!r}: no readable replica ({last})")

    def read_many(self, metas: list, views: list) -> list[bool]:
        """One batch of READs from each object's first replica; stragglers retried singly.
        ``views[i]`` is the list of buffers object ``i`` is read into (None: skip it)."""
        picks = [(i, m) for i, m in enumerate(metas) if m and m.replicas and views[i] is not None]
        reqs, owners = [], []
        for i, m in picks:
            batch = requests(Op.READ, views[i], m.replicas[0], self.engine)
            reqs.extend(batch)
            owners.extend([i] * len(batch))
        try:
            statuses = self.engine.transfer_statuses(reqs, self.timeout) if reqs else []
        except KVPoolError as exc:  # a replica's segment cannot be resolved: try one by one
            logger.debug("store: batched read failed (%s); reading one by one", exc)
            statuses = [None] * len(reqs)
        moved = dict.fromkeys((i for i, _ in picks), True)
        for i, status in zip(owners, statuses, strict=True):
            moved[i] = moved[i] and status is not None and status.ok
        ok = [False] * len(metas)
        for i, m in picks:
            if moved[i] and self.verified(m, views[i]):
                ok[i] = True
                continue
            try:
                self.read(m, views[i])
                ok[i] = True
            except NotFoundError:
                pass
        return ok

    def read_ranges(self, meta: ObjectDesc, views: list[tuple[int, memoryview]]) -> None:
        """Byte ranges ``[(offset in the value, buffer), ...]`` from the first replica that
        serves them (not verified: only whole values can be); ``NotFoundError`` otherwise."""
        if any(off < 0 or off + len(v) > meta.size for off, v in views):
            raise BadRequestError(f"a range is outside the {meta.size}-byte value of "
                                  f"{meta.key!r}")  # fmt: skip
        last: Exception | None = None
        for r in meta.replicas:
            if r.owner:
                self.engine.expect_owner(r.segment, r.owner)
            reqs = [TransferRequest(Op.READ, v, r.segment, r.offset + off)
                    for off, v in views if len(v)]  # fmt: skip
            try:
                self.engine.transfer(reqs, timeout=self.timeout)
                return
            except KVPoolError as exc:
                last = exc
        raise NotFoundError(f"key {meta.key!r}: no readable replica ({last})")

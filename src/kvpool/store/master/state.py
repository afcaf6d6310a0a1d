"""The master's state machine: object table, segment allocators, leases, eviction, node expiry.

Pure logic with an injected clock and no I/O, so every rule is tested exactly; the RPC service
wraps it (one lock around every call). Semantics follow Mooncake Store:

- ``put_start`` allocates replicas on distinct nodes and records the object PROCESSING (not
  visible), under a random ``put_id`` that only the putting client learns; the client writes
  the bytes through the transfer engine; ``put_end`` with that id and the value's checksum
  makes it COMPLETE; ``put_revoke`` (or the put deadline) frees the space. A client's
  unfinished puts may hold at most ``max_pending_bytes``.
- ``get`` returns COMPLETE objects only and grants a read lease that blocks eviction and
  removal until it runs out; ``remove`` is refused while leased unless forced.
- Space: when a put cannot allocate, or a tier passes its high watermark, objects are evicted
  down to the low watermark, coldest first (decayed access frequency: recency and frequency in
  one score), never leased, in-flight or cooling-down ones, soft-pinned ones last.
- Nodes heartbeat; a node silent for ``node_ttl`` is dropped with its replicas, one that leaves
  (``unmount``) at once. A node that comes back as a new process (another ``incarnation``)
  starts clean: what the old one held is gone with its memory.
- "Already exists" only ever means a COMPLETE object with a replica on a live node: a put of
  a key whose replicas are all on nodes silent for ``node_suspect_after`` replaces it, and a
  put of a key another put has not ended yet gets ``PutInProgressError``.
"""

from __future__ import annotations

import secrets
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.common.errors import (
    AlreadyExistsError,
    BackpressureError,
    BadRequestError,
    LeaseExpiredError,
    NoSpaceError,
    NotFoundError,
    PutInProgressError,
)
from kvpool.config import MAX_REPLICAS, MasterConfig
from kvpool.store.master import tiering
from kvpool.store.master.allocator import OffsetAllocator
from kvpool.store.master.objects import ObjectMeta, ObjectState, Replica, Tier

MAX_KEY_BYTES = 4096


@dataclass(slots=True)
class MountedSegment:
    node_id: str
    name: str
    tier: Tier
    allocator: OffsetAllocator
    ready: bool = True  # False while its node still reports what it holds: no allocations
    owner: str = ""  # the incarnation of the node that mounted it (its transfer engine's id)


@dataclass(slots=True)
class Node:
    node_id: str
    last_seen: float
    segments: list[str]
    incarnation: str = ""  # which process of the node (a restart is a new one)


class MasterState:
    """Metadata of the whole pool (never any value bytes)."""

    def __init__(
        self, config: MasterConfig | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.config = config or MasterConfig()
        self.clock = clock
        self.objects: dict[str, ObjectMeta] = {}
        self.segments: dict[str, MountedSegment] = {}
        self.nodes: dict[str, Node] = {}
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "gets", "hits", "misses", "evictions", "revokes", "lease_conflicts",
             "offloads", "promotions"),
            0,
        )  # fmt: skip
        # copies bytes between two replicas on one node (DRAM <-> SSD); None: no tiering
        self.mover: Callable[[Replica, Replica, int], bool] | None = None
        self.pending_bytes: dict[str, int] = defaultdict(int)  # by client: unfinished puts

    # -- nodes and segments ---------------------------------------------------------------------

    def mount(
        self,
        node_id: str,
        segment: str,
        tier: Tier,
        capacity: int,
        ready: bool = True,
        incarnation: str = "",
    ) -> None:
        """A node offers ``capacity`` bytes of ``segment`` (re-mounting the same is a no-op);
        not ``ready``: it takes no allocation until ``segment_ready``. A known node id with
        another ``incarnation`` is a new process: the old one's objects are dropped first."""
        known = self.nodes.get(node_id)
        if known is not None and incarnation and known.incarnation != incarnation:
            self.drop_node(node_id)
        if capacity <= 0 or capacity > 1 << 50:
            raise BadRequestError("segment capacity must be in (0, 2**50] bytes")
        if not isinstance(segment, str) or not 0 < len(segment) <= 255:
            raise BadRequestError("a segment name must be 1..255 characters")
        old = self.segments.get(segment)
        if old is not None:
            if old.node_id != node_id:
                raise AlreadyExistsError(f"segment {segment!r} belongs to node {old.node_id}")
            return
        node = self.nodes.setdefault(node_id, Node(node_id, self.clock(), [], incarnation))
        node.last_seen = self.clock()
        node.segments.append(segment)
        self.segments[segment] = MountedSegment(node_id, segment, tier, OffsetAllocator(capacity),
                                                ready, incarnation)  # fmt: skip

    def segment_ready(self, node_id: str, segment: str) -> None:
        seg = self.segments.get(segment)
        if seg is None or seg.node_id != node_id:
            raise BadRequestError(f"segment {segment!r} is not mounted by {node_id}")
        seg.ready = True

    def heartbeat(self, node_id: str, incarnation: str = "") -> bool:
        """False if the master does not know the node, or knows another process of it (it
        must mount again)."""
        node = self.nodes.get(node_id)
        if node is None or (incarnation and node.incarnation != incarnation):
            return False
        node.last_seen = self.clock()
        return True

    def unmount(self, node_id: str, incarnation: str = "") -> list[str]:
        """A node leaves: it and every replica on it go at once; the keys that went with it."""
        node = self.nodes.get(node_id)
        if node is None or (incarnation and node.incarnation != incarnation):
            return []
        return self.drop_node(node_id)

    def drop_node(self, node_id: str) -> list[str]:
        """Forget a node and every replica on it; the keys that lost their last replica."""
        node = self.nodes.pop(node_id, None)
        if node is None:
            return []
        for name in node.segments:
            self.segments.pop(name, None)
        lost = []
        for key, meta in list(self.objects.items()):
            kept = [r for r in meta.replicas if r.node_id != node_id]
            if len(kept) != len(meta.replicas):
                meta.replicas = kept
                if not kept:
                    self._settle(meta)
                    del self.objects[key]
                    lost.append(key)
        return lost

    def adopt(
        self, node_id: str, key: str, size: int, replica: Replica, checksum: int | None
    ) -> None:
        """A node reports an object it holds (a fresh master rebuilding its table)."""
        seg = self.segments.get(replica.segment)
        if seg is None or seg.node_id != node_id:
            raise BadRequestError(f"segment {replica.segment!r} is not mounted by {node_id}")
        seg.allocator.reserve(replica.offset, size)
        meta = self.objects.get(key)
        now = self.clock()
        if meta is None:
            meta = self.objects[key] = ObjectMeta(key, size, [], now, ObjectState.COMPLETE)
            meta.checksum = checksum
        elif meta.size != size:
            seg.allocator.free(replica.offset)
            raise BadRequestError(f"node {node_id} reports {key!r} with a different size")
        meta.replicas.append(replica)

    # -- puts -----------------------------------------------------------------------------------

    def put_start(
        self, key: str, size: int, replicas: int | None = None, owner: str = "local"
    ) -> ObjectMeta:
        """Allocate ``replicas`` copies on distinct nodes (DRAM first, evicting if needed) for
        client ``owner``; the object's ``put_id`` is what ends or revokes the put."""
        _check_key(key)
        want = self.config.replicas if replicas is None else replicas
        if not _is_int(want) or not 1 <= want <= MAX_REPLICAS:
            raise BadRequestError(f"replicas must be an integer in [1, {MAX_REPLICAS}]")
        if not _is_int(size) or not 0 < size <= self.config.max_object_bytes:
            raise BadRequestError(
                f"value size {size} not in [1, {self.config.max_object_bytes}] bytes"
            )
        old = self.objects.get(key)
        if old is not None:
            if old.state is ObjectState.PROCESSING:
                raise PutInProgressError(f"a put of key {key!r} is in progress")
            if not self._on_suspect_nodes(old):
                raise AlreadyExistsError(f"key {key!r} already exists (objects are immutable)")
            self._delete(old)  # its nodes went silent: not there any more, a real put
        held, cap = self.pending_bytes.get(owner, 0), self.config.max_pending_bytes
        if held + size * want > cap:
            raise BackpressureError(
                f"client {owner} has {held} bytes in unfinished puts (at most {cap}): end or "
                "revoke them first"
            )
        placed = self._place(size, want)
        now = self.clock()
        deadline = now + self.config.put_timeout + size / self.config.put_min_rate
        meta = ObjectMeta(key, size, placed, now, put_deadline=deadline,
                          put_id=secrets.randbits(63) or 1, owner=owner,
                          pending=size * len(placed))  # fmt: skip
        self.pending_bytes[owner] += meta.pending
        self.objects[key] = meta
        self.counters["puts"] += 1
        return meta

    def put_end(self, key: str, put_id: int, checksum: int) -> None:
        """Make the put ``put_id`` of ``key`` COMPLETE with the value's ``checksum`` (64-bit)."""
        meta = self._processing(key, put_id)
        if not _is_int(checksum) or not 0 <= checksum < 1 << 64:
            raise BadRequestError("checksum must be an unsigned 64-bit integer")
        self._settle(meta)
        meta.state = ObjectState.COMPLETE
        meta.checksum = checksum
        meta.touch(self.clock(), self.config.half_life)

    def put_revoke(self, key: str, put_id: int) -> None:
        self._revoke(self._processing(key, put_id))

    def _revoke(self, meta: ObjectMeta) -> None:
        self._delete(meta)
        self.counters["revokes"] += 1

    def _settle(self, meta: ObjectMeta) -> None:
        """The put is over: its bytes no longer count against its client (idempotent)."""
        if not meta.pending:
            return
        left = self.pending_bytes.get(meta.owner, 0) - meta.pending
        meta.pending = 0
        if left > 0:
            self.pending_bytes[meta.owner] = left
        else:
            self.pending_bytes.pop(meta.owner, None)

    # -- reads and removal ------------------------------------------------------------------------

    def get(self, key: str) -> ObjectMeta:
        """A COMPLETE object's replicas, with a read lease of ``lease_ttl``."""
        self.counters["gets"] += 1
        meta = self.objects.get(key)
        if meta is None or meta.state is not ObjectState.COMPLETE or not meta.replicas:
            self.counters["misses"] += 1
            raise NotFoundError(f"key {key!r} not found")
        now = self.clock()
        tiering.promote(self, meta, now)  # before the lease: nobody reads the old copy then
        meta.lease_until = max(meta.lease_until, now + self.config.lease_ttl)
        meta.touch(now, self.config.half_life)
        self.counters["hits"] += 1
        return meta

    def exists(self, key: str) -> bool:
        meta = self.objects.get(key)
        return meta is not None and meta.state is ObjectState.COMPLETE and bool(meta.replicas)

    def remove(self, key: str, force: bool = False) -> None:
        meta = self.objects.get(key)
        if meta is None or meta.state is not ObjectState.COMPLETE:
            raise NotFoundError(f"key {key!r} not found")
        if meta.leased(self.clock()) and not force:
            self.counters["lease_conflicts"] += 1
            raise LeaseExpiredError(f"key {key!r} is leased by a reader; remove(force=True)")
        self._delete(meta)

    def pin(self, key: str, pinned: bool = True) -> None:
        meta = self.objects.get(key)
        if meta is None:
            raise NotFoundError(f"key {key!r} not found")
        meta.pinned = pinned

    # -- time -----------------------------------------------------------------------------------

    def tick(self) -> tuple[list[str], list[str]]:
        """Revoke puts past their deadline and drop silent nodes: (revoked keys, dropped nodes)."""
        now = self.clock()
        late = [
            m for m in self.objects.values()
            if m.state is ObjectState.PROCESSING and m.put_deadline < now
        ]  # fmt: skip
        for meta in late:
            self._revoke(meta)
        revoked = [m.key for m in late]
        dead = [n.node_id for n in self.nodes.values() if now - n.last_seen > self.config.node_ttl]
        for node_id in dead:
            self.drop_node(node_id)
        return revoked, dead

    # -- space ----------------------------------------------------------------------------------

    def usage(self, tier: Tier = Tier.DRAM) -> tuple[int, int]:
        """(used, capacity) bytes of a tier over every mounted segment."""
        segs = [s for s in self.segments.values() if s.tier is tier]
        return sum(s.allocator.used for s in segs), sum(s.allocator.capacity for s in segs)

    def _place(self, size: int, want: int) -> list[Replica]:
        """One allocation per distinct node, most free space first; evict when none fits."""
        placed: list[Replica] = []
        try:
            for _ in range(want):
                taken = {r.node_id for r in placed}
                replica = self._allocate(size, taken)
                if replica is None:
                    self.evict(Tier.DRAM, need=size, exclude_nodes=taken)
                    replica = self._allocate(size, taken)
                if replica is None:
                    if placed:  # fewer replicas than asked beats no object at all
                        break
                    raise NoSpaceError(f"no DRAM segment can hold {size} bytes now")
                placed.append(replica)
        except BaseException:
            for r in placed:
                self.segments[r.segment].allocator.free(r.offset)
            raise
        self._evict_to_watermark()
        return placed

    def _allocate(self, size: int, skip_nodes: set[str]) -> Replica | None:
        segs = [
            s for s in self.segments.values()
            if s.tier is Tier.DRAM and s.ready and s.node_id not in skip_nodes
        ]  # fmt: skip
        segs.sort(key=lambda s: s.allocator.free_bytes, reverse=True)
        for seg in segs:
            if size > seg.allocator.capacity:
                continue
            offset = seg.allocator.allocate(size)
            if offset is not None:
                return Replica(seg.node_id, seg.name, offset, seg.tier)
        return None

    def evict(self, tier: Tier, need: int = 0, exclude_nodes: set[str] | None = None) -> list[str]:
        """Evict coldest objects of ``tier`` until ``need`` more bytes are free and usage is
        at or below the low watermark; the evicted keys (in eviction order)."""
        now = self.clock()
        used, cap = self.usage(tier)
        target = min(cap * self.config.low_watermark, cap - need)
        victims = sorted(
            (m for m in self.objects.values() if self._evictable(m, now, tier, exclude_nodes)),
            key=lambda m: (m.pinned, m.heat(now, self.config.half_life), m.last_access),
        )
        evicted = []
        for meta in victims:
            if used <= target:
                break
            used -= meta.size * len(meta.replicas_on(tier))
            if tier is Tier.DRAM and self.mover is not None:
                if not tiering.offload(self, meta, now):
                    self._delete(meta)
            else:
                self._delete(meta)
            evicted.append(meta.key)
        self.counters["evictions"] += len(evicted)
        return evicted

    def _evict_to_watermark(self) -> None:
        used, cap = self.usage(Tier.DRAM)
        if cap and used > cap * self.config.high_watermark:
            self.evict(Tier.DRAM)

    def _evictable(self, m: ObjectMeta, now: float, tier: Tier, exclude: set[str] | None) -> bool:
        if m.state is not ObjectState.COMPLETE or m.leased(now) or m.cooldown_until > now:
            return False
        on_tier = m.replicas_on(tier)
        return bool(on_tier) and not (exclude and all(r.node_id in exclude for r in on_tier))

    # -- helpers --------------------------------------------------------------------------------

    def _on_suspect_nodes(self, meta: ObjectMeta) -> bool:
        """Whether every replica of ``meta`` is on a node silent for ``node_suspect_after``."""
        now, after = self.clock(), self.config.node_suspect_after
        nodes = [self.nodes.get(r.node_id) for r in meta.replicas]
        return all(n is None or now - n.last_seen > after for n in nodes)

    def _processing(self, key: str, put_id: int) -> ObjectMeta:
        meta = self.objects.get(key)
        if meta is None or meta.state is not ObjectState.PROCESSING or meta.put_id != put_id:
            raise NotFoundError(f"no put {put_id!r} in progress for key {key!r}")
        return meta

    def on_move(self, meta: ObjectMeta, old: Replica, new: Replica) -> None:
        """A replica moved between tiers (the service tells the node)."""

    def free_replica(self, replica: Replica) -> None:
        seg = self.segments.get(replica.segment)
        if seg is not None:
            seg.allocator.free(replica.offset)

    def drop_replicas(self, meta: ObjectMeta, segment: str) -> None:
        """Drop ``meta``'s replicas in ``segment``; the object goes with its last replica."""
        gone = [r for r in meta.replicas if r.segment == segment]
        if len(gone) == len(meta.replicas):
            self._delete(meta)
            return
        for r in gone:
            self.free_replica(r)
            self.on_move(meta, r, None)
        meta.replicas = [r for r in meta.replicas if r.segment != segment]

    def _delete(self, meta: ObjectMeta) -> None:
        self._settle(meta)
        for r in meta.replicas:
            seg = self.segments.get(r.segment)
            if seg is not None:
                seg.allocator.free(r.offset)
        meta.replicas = []
        self.objects.pop(meta.key, None)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise BadRequestError("a key must be a non-empty string")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise BadRequestError(f"a key must be at most {MAX_KEY_BYTES} bytes")

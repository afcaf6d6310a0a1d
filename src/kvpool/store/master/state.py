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
- Space (``placement.py``): when a put cannot allocate, or a tier passes its high watermark,
  objects are evicted down to the low watermark, coldest first (decayed access frequency:
  recency and frequency in one score), never leased, in-flight, cooling-down or hard-pinned
  ones, soft-pinned ones last. Puts and upserts are in ``puts.py``.
- Nodes heartbeat; a node silent for ``node_ttl`` is dropped with its replicas, one that leaves
  (``unmount``) at once. A node that comes back as a new process (another ``incarnation``)
  starts clean: what the old one held is gone with its memory.
- "Already exists" only ever means a COMPLETE object with a replica on a live node: a put of
  a key whose replicas are all on *suspect* nodes (silent for ``node_suspect_after``, or
  reported unreachable by a client since their last heartbeat) replaces it, and a put of a key
  another put has not ended yet gets ``PutInProgressError``. New replicas go to suspect nodes
  only when nothing else fits.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.common.errors import (
    AlreadyExistsError,
    BadRequestError,
    LeaseExpiredError,
    NotFoundError,
)
from kvpool.config import MasterConfig
from kvpool.store.master import placement, puts, tiering
from kvpool.store.master.allocator import OffsetAllocator
from kvpool.store.master.objects import ObjectMeta, ObjectState, PutOptions, Replica, Tier
from kvpool.store.master.view import MountedSegment


@dataclass(slots=True)
class Node:
    node_id: str
    last_seen: float
    segments: list[str]
    incarnation: str = ""  # which process of the node (a restart is a new one)
    reported: float = -math.inf  # when a client last could not reach it (its next heartbeat
    # clears that: see ``suspect``)


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
             "offloads", "promotions", "unconfirmed_commits"),
            0,
        )  # fmt: skip
        # copies bytes between two replicas on one node (DRAM <-> SSD); None: no tiering
        self.mover: Callable[[Replica, Replica, int], bool] | None = None
        # a copy started now and finished later: ``done(ok)`` is called with the state's lock
        # held (promotions use it when set, so a get never waits for a node)
        self.mover_async: Callable[[Replica, Replica, int, Callable[[bool], None]], None] | None \
            = None  # fmt: skip
        self.moving: dict[str, int] = {}  # key -> its copies in flight (promotion, offload)
        self.drop_evicts = False  # evict by dropping, never offloading (the last resort)
        self.pending_bytes: dict[str, int] = defaultdict(int)  # by client: unfinished puts
        self.upserts: dict[str, ObjectMeta] = {}  # new versions of existing keys, in progress
        self.retired: list[tuple[Replica, float]] = []  # old versions' replicas, freed after

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
        for meta in [*self.objects.values(), *self.upserts.values()]:
            kept = [r for r in meta.replicas if r.node_id != node_id]
            if len(kept) != len(meta.replicas):
                meta.replicas = kept
                if not kept:
                    self.delete(meta)
                    lost.append(meta.key)
        self.retired = [(r, t) for r, t in self.retired if r.node_id != node_id]
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

    # -- puts (``puts.py``) ----------------------------------------------------------------

    def put_start(self, key: str, size: int, replicas: int | None = None, owner: str = "local",
                  opts: PutOptions | None = None) -> ObjectMeta:  # fmt: skip
        """Allocate ``replicas`` copies on distinct nodes (DRAM first, evicting if needed) for
        client ``owner``; the object's ``put_id`` is what ends or revokes the put."""
        return puts.start(self, key, size, replicas, owner, opts or PutOptions())

    def put_end(self, key: str, put_id: int, checksum: int) -> None:
        """Make the put ``put_id`` of ``key`` COMPLETE with the value's ``checksum`` (64-bit)."""
        puts.end(self, key, put_id, checksum)

    def put_revoke(self, key: str, put_id: int) -> None:
        puts.revoke(self, puts.in_progress(self, key, put_id))

    def settle(self, meta: ObjectMeta) -> None:
        """The put is over: its bytes no longer count against its client (idempotent)."""
        if not meta.pending:
            return
        left = self.pending_bytes.get(meta.owner, 0) - meta.pending
        meta.pending = 0
        if left > 0:
            self.pending_bytes[meta.owner] = left
        else:
            self.pending_bytes.pop(meta.owner, None)

    def retire(self, meta: ObjectMeta, now: float) -> None:
        """An upsert replaced ``meta``: its replicas go as soon as no lease covers them."""
        self.on_retire(meta)
        for r in meta.replicas:
            if meta.leased(now):
                self.retired.append((r, meta.lease_until))
            else:
                self.free_replica(r)
        meta.replicas = []

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
        """Whether ``key`` is a COMPLETE object; if so it gets a read lease, as in Mooncake
        (a lookup is followed by a read: the object must not go in between)."""
        meta = self.objects.get(key)
        found = meta is not None and meta.state is ObjectState.COMPLETE and bool(meta.replicas)
        if found:
            meta.lease_until = max(meta.lease_until, self.clock() + self.config.lease_ttl)
        return found

    def tier(self, key: str) -> str | None:
        """``exists`` that also says where a read would come from: "dram" if a DRAM replica
        holds ``key``, else "ssd"; None when it is not a COMPLETE object."""
        if not self.exists(key):
            return None
        meta = self.objects[key]
        return Tier.DRAM.value if meta.replicas_on(Tier.DRAM) else Tier.SSD.value

    def remove(self, key: str, force: bool = False) -> None:
        meta = self.objects.get(key)
        if meta is None or meta.state is not ObjectState.COMPLETE:
            raise NotFoundError(f"key {key!r} not found")
        if meta.leased(self.clock()) and not force:
            self.counters["lease_conflicts"] += 1
            raise LeaseExpiredError(f"key {key!r} is leased by a reader; remove(force=True)")
        self.delete(meta)

    def remove_matching(self, pattern: str | None, force: bool = False) -> int:
        """Remove every COMPLETE object (whose key ``pattern`` matches, ``re.search``), but
        those a reader holds a lease on unless ``force``; how many went."""
        try:
            regex = None if pattern is None else re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise BadRequestError(f"invalid regular expression: {exc}") from None
        now = self.clock()
        gone = [m for m in self.objects.values() if m.state is ObjectState.COMPLETE
                and (regex is None or regex.search(m.key)) and (force or not m.leased(now))]  # fmt: skip
        for meta in gone:
            self.delete(meta)
        return len(gone)

    def pin(self, key: str, pinned: bool = True, ttl: float | None = None) -> None:
        """Soft-pin ``key`` (for ``ttl`` seconds, or as long as it lives) or unpin it."""
        meta = self.objects.get(key)
        if meta is None:
            raise NotFoundError(f"key {key!r} not found")
        meta.pinned = pinned
        meta.pin_until = math.inf if ttl is None else self.clock() + ttl

    # -- time -----------------------------------------------------------------------------------

    def tick(self) -> tuple[list[str], list[str]]:
        """Revoke puts past their deadline, free retired replicas no lease covers, drop silent
        nodes: (revoked keys, dropped nodes)."""
        now = self.clock()
        revoked = puts.expire(self, now)
        due = [r for r, until in self.retired if until <= now]
        self.retired = [(r, until) for r, until in self.retired if until > now]
        for r in due:
            self.free_replica(r)
        dead = [n.node_id for n in self.nodes.values() if now - n.last_seen > self.config.node_ttl]
        for node_id in dead:
            self.drop_node(node_id)
        return revoked, dead

    # -- space (``placement.py``) -----------------------------------------------------------------

    def usage(self, tier: Tier = Tier.DRAM) -> tuple[int, int]:
        """(used, capacity) bytes of a tier over every mounted segment."""
        return placement.usage(self, tier)

    def evict(self, tier: Tier, need: int = 0, exclude_nodes: set[str] | None = None) -> list[str]:
        """Evict coldest objects of ``tier`` until ``need`` more bytes are free and usage is
        at or below the low watermark; the evicted keys (in eviction order)."""
        return placement.evict(self, tier, need, exclude_nodes)

    # -- helpers --------------------------------------------------------------------------------

    def suspect(self, node_id: str) -> bool:
        """Whether a node may be gone: unknown, silent for ``node_suspect_after``, or reported
        unreachable since its last heartbeat (so a false report lasts one heartbeat)."""
        node = self.nodes.get(node_id)
        return node is None or self.clock() - node.last_seen > self.config.node_suspect_after \
            or node.reported >= node.last_seen  # fmt: skip

    def report_unreachable(self, node_ids: list[str]) -> int:
        """A client could not read from these nodes; how many the master knows."""
        known = [self.nodes[n] for n in node_ids if n in self.nodes]
        for node in known:
            node.reported = self.clock()
        return len(known)

    def on_suspect_nodes(self, meta: ObjectMeta) -> bool:
        """Whether every replica of ``meta`` is on a suspect node."""
        return all(self.suspect(r.node_id) for r in meta.replicas)

    def on_move(self, meta: ObjectMeta, old: Replica, new: Replica | None) -> None:
        """A replica moved between tiers (the service tells the node)."""

    def on_retire(self, meta: ObjectMeta) -> None:
        """An upsert replaced ``meta`` (the service tells its nodes)."""

    def free_replica(self, replica: Replica) -> None:
        seg = self.segments.get(replica.segment)
        if seg is not None:
            seg.allocator.free(replica.offset)

    def drop_replicas(self, meta: ObjectMeta, segment: str) -> None:
        """Drop ``meta``'s replicas in ``segment``; the object goes with its last replica."""
        gone = [r for r in meta.replicas if r.segment == segment]
        if len(gone) == len(meta.replicas):
            self.delete(meta)
            return
        for r in gone:
            self.free_replica(r)
            self.on_move(meta, r, None)
        meta.replicas = [r for r in meta.replicas if r.segment != segment]

    def delete(self, meta: ObjectMeta) -> None:
        """``meta`` goes, with its replicas (an unfinished upsert leaves the old version)."""
        self.settle(meta)
        for r in meta.replicas:
            self.free_replica(r)
        meta.replicas = []
        if self.objects.get(meta.key) is meta:
            del self.objects[meta.key]
        elif self.upserts.get(meta.key) is meta:
            del self.upserts[meta.key]

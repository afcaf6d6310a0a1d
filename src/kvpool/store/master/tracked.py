"""The master's state with what its nodes must learn: per node, the replicas committed to and
deleted from it since its last heartbeat (its index deltas), resent until acknowledged; and
objects as clients see them (``wire``). A new delta nudges its node (``on_delta``) to fetch
it at once: what a standby master rebuilds after a fail-over comes from the nodes' indexes,
so a commit is safe once its nodes hold it (milliseconds, not a heartbeat, after put_end)."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable

from kvpool.config import MasterConfig
from kvpool.protocol.store import IndexDelta, ObjectDesc, ReplicaDesc
from kvpool.store.master.objects import ObjectMeta, ObjectState, Replica
from kvpool.store.master.state import MasterState


class TrackedState(MasterState):
    """MasterState that records, per node, the replicas committed and deleted since the node's
    last heartbeat (the node's index deltas)."""

    def __init__(self, config: MasterConfig, clock: Callable[[], float]) -> None:
        super().__init__(config, clock)
        self.deltas: dict[str, list] = defaultdict(list)
        # seq of each node's first undelivered-or-unacknowledged delta: a delta stays queued
        # until the node acknowledges it, so a lost heartbeat reply loses nothing
        self.delta_base: dict[str, int] = defaultdict(lambda: 1)
        self.epoch = uuid.uuid4().hex  # acks of another master's deltas mean nothing here
        # a node's delta stream: its seqs restart when the node is dropped and mounts again
        # (a new process under the same id, say), so an ack of the old stream must not
        # discard deltas of the new one: each stream has its own epoch
        self._streams: dict[str, str] = {}
        self._stream_count = 0
        self.on_delta: Callable[[str], None] | None = None  # a node has new deltas (a nudge)

    def _delta(self, node_id: str, delta: IndexDelta) -> None:
        self.deltas[node_id].append(delta.to_wire())  # queued as sent: resent until acked
        if self.on_delta is not None:
            self.on_delta(node_id)

    def describe(self, meta: ObjectMeta, lease_ttl: float = 0.0,
                 put_id: int | None = None) -> ObjectDesc:  # fmt: skip
        """An object as the client sees it: its replicas, each with the incarnation of the
        process that owns its segment (so a client never writes or reads through a
        descriptor of a previous life of that node)."""
        replicas = []
        for r in meta.replicas:
            seg = self.segments.get(r.segment)
            replicas.append(ReplicaDesc(r.node_id, r.segment, r.offset, r.tier.value,
                                        seg.owner if seg is not None else ""))  # fmt: skip
        return ObjectDesc(meta.key, meta.size, tuple(replicas), meta.checksum, lease_ttl, put_id)

    def wire(self, meta: ObjectMeta, lease_ttl: float = 0.0) -> dict:
        return self.describe(meta, lease_ttl).to_wire()

    def started(self, meta: ObjectMeta) -> dict:
        """What put_start answers: where to write, and the put id that ends (or revokes) it."""
        return self.describe(meta, put_id=meta.put_id).to_wire()

    def stream_epoch(self, node_id: str) -> str:
        """The epoch of the node's current delta stream (what its acks must name)."""
        epoch = self._streams.get(node_id)
        if epoch is None:
            self._stream_count += 1
            epoch = self._streams[node_id] = f"{self.epoch}.{self._stream_count}"
        return epoch

    def take_deltas(self, node_id: str, epoch: str | None, ack: int) -> tuple[list, int]:
        """Drop the node's deltas up to ``ack`` (if it speaks of its current stream); (the
        rest, last seq)."""
        queue, base = self.deltas[node_id], self.delta_base[node_id]
        if epoch == self.stream_epoch(node_id) and ack >= base:
            done = min(ack - base + 1, len(queue))
            del queue[:done]
            self.delta_base[node_id] = base = base + done
        return list(queue), base + len(queue) - 1

    def put_end(self, key: str, put_id: int, checksum: int) -> None:
        super().put_end(key, put_id, checksum)
        meta = self.objects[key]
        for r in meta.replicas:
            self._delta(r.node_id, IndexDelta.add(key, meta.size, r.segment, r.offset, checksum))

    def delete(self, meta: ObjectMeta) -> None:
        self.on_retire(meta)
        super().delete(meta)

    def on_retire(self, meta: ObjectMeta) -> None:
        """``meta``'s replicas leave their nodes' indexes (deleted, or replaced by an upsert)."""
        if meta.state is ObjectState.COMPLETE:
            for r in meta.replicas:
                self._delta(r.node_id, IndexDelta.delete(meta.key, r.segment, r.offset))

    def on_move(self, meta: ObjectMeta, old: Replica, new: Replica | None) -> None:
        if meta.state is not ObjectState.COMPLETE:
            return
        self._delta(old.node_id, IndexDelta.delete(meta.key, old.segment, old.offset))
        if new is not None:
            self._delta(new.node_id, IndexDelta.add(meta.key, meta.size, new.segment, new.offset,
                                                    meta.checksum))  # fmt: skip

    def drop_node(self, node_id: str) -> list[str]:
        self.deltas.pop(node_id, None)
        self.delta_base.pop(node_id, None)
        self._streams.pop(node_id, None)
        return super().drop_node(node_id)

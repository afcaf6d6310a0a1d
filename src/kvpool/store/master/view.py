"""What the master's rule modules (``placement``, ``puts``, ``tiering``) may use of the state.

``MasterState`` owns the tables and calls those modules; they see it only through this
protocol, so the dependency points one way (state -> rules -> this view -> objects) and each
rule module lists exactly what it touches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvpool.common.errors import NoSpaceError
from kvpool.config import MasterConfig
from kvpool.store.master.allocator import OffsetAllocator
from kvpool.store.master.objects import ObjectMeta, Replica, Tier


@dataclass(slots=True)
class MountedSegment:
    node_id: str
    name: str
    tier: Tier
    allocator: OffsetAllocator
    ready: bool = True  # False while its node still reports what it holds: no allocations
    owner: str = ""  # the incarnation of the node that mounted it (its transfer engine's id)


class MovesPending(NoSpaceError):
    """No room now, but offloads in flight will make some: try again when they end (the
    service waits for them outside its lock)."""


class StateView(Protocol):
    config: MasterConfig
    clock: Callable[[], float]
    objects: dict[str, ObjectMeta]
    upserts: dict[str, ObjectMeta]  # new versions of existing keys, in progress
    segments: dict[str, MountedSegment]
    counters: dict[str, int]
    pending_bytes: dict[str, int]
    mover: Callable[[Replica, Replica, int], bool] | None
    mover_async: Callable[[Replica, Replica, int, Callable[[bool], None]], None] | None
    moving: dict[str, int]
    drop_evicts: bool
    retired: list[tuple[Replica, float]]

    def settle(self, meta: ObjectMeta) -> None: ...
    def retire(self, meta: ObjectMeta, now: float) -> None: ...
    def suspect(self, node_id: str) -> bool: ...
    def on_suspect_nodes(self, meta: ObjectMeta) -> bool: ...
    def on_move(self, meta: ObjectMeta, old: Replica, new: Replica | None) -> None: ...
    def free_replica(self, replica: Replica) -> None: ...
    def drop_replicas(self, meta: ObjectMeta, segment: str) -> None: ...
    def delete(self, meta: ObjectMeta) -> None: ...

"""Where bytes go and what leaves when space runs out (functions over a ``StateView``).

Placement: one replica per distinct node, on nodes that are not suspect first (silent, or
reported unreachable), then the preferred nodes or segments, then most free space; eviction when nothing fits. Eviction: from the high watermark down to the low
one, coldest first (decayed access frequency), never leased, in-flight, cooling-down or
hard-pinned objects, soft-pinned ones (while their pin lasts) last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.common.errors import NoSpaceError
from kvpool.store.master import tiering
from kvpool.store.master.objects import ObjectMeta, ObjectState, Replica, Tier
from kvpool.store.master.view import MovesPending

if TYPE_CHECKING:
    from kvpool.store.master.view import StateView


def usage(state: StateView, tier: Tier = Tier.DRAM) -> tuple[int, int]:
    """(used, capacity) bytes of a tier over every mounted segment."""
    segs = [s for s in state.segments.values() if s.tier is tier]
    return sum(s.allocator.used for s in segs), sum(s.allocator.capacity for s in segs)


def place(state: StateView, size: int, want: int, preferred: tuple[str, ...] = ()) -> list[Replica]:
    """``want`` allocations of ``size`` bytes on distinct nodes (fewer if there are fewer
    nodes); evicts when none fits; NoSpaceError when not even one does."""
    placed: list[Replica] = []
    try:
        for _ in range(want):
            taken = {r.node_id for r in placed}
            replica = allocate(state, size, taken, preferred)
            if replica is None:
                evict(state, Tier.DRAM, need=size, exclude_nodes=taken)
                replica = allocate(state, size, taken, preferred)
            if replica is None:
                if placed:  # fewer replicas than asked beats no object at all
                    break
                if state.moving and not state.drop_evicts:
                    raise MovesPending(f"no DRAM for {size} bytes until offloads end")
                raise NoSpaceError(f"no DRAM segment can hold {size} bytes now")
            placed.append(replica)
    except BaseException:
        for r in placed:
            state.free_replica(r)
        raise
    evict_to_watermark(state)
    return placed


def allocate(state: StateView, size: int, skip_nodes: set[str],
             preferred: tuple[str, ...] = ()) -> Replica | None:  # fmt: skip
    segs = [
        s for s in state.segments.values()
        if s.tier is Tier.DRAM and s.ready and s.node_id not in skip_nodes
    ]  # fmt: skip
    wanted = set(preferred)
    segs.sort(key=lambda s: (state.suspect(s.node_id), s.name not in wanted and
                             s.node_id not in wanted, -s.allocator.free_bytes))  # fmt: skip
    for seg in segs:
        if size > seg.allocator.capacity:
            continue
        offset = seg.allocator.allocate(size)
        if offset is not None:
            return Replica(seg.node_id, seg.name, offset, seg.tier)
    return None


def evict(state: StateView, tier: Tier, need: int = 0,
          exclude_nodes: set[str] | None = None) -> list[str]:  # fmt: skip
    """Evict coldest objects of ``tier`` until ``need`` more bytes are free and usage is at or
    below the low watermark; the evicted keys (in eviction order)."""
    now = state.clock()
    cfg = state.config
    used, cap = usage(state, tier)
    if state.moving and not state.drop_evicts:  # what offloads in flight free counts already
        used -= sum(m.size * len(m.replicas_on(tier)) for k in state.moving
                    if (m := state.objects.get(k)) is not None)  # fmt: skip
    target = min(cap * cfg.low_watermark, cap - need)
    victims = sorted(
        (
            m
            for m in state.objects.values()
            if _evictable(m, now, tier, exclude_nodes, {} if state.drop_evicts else state.moving)
        ),
        key=lambda m: m.eviction_order(now, cfg.half_life),
    )
    evicted = []
    later = tier is Tier.DRAM and state.mover_async is not None and not state.drop_evicts
    for meta in victims:
        if used <= target:
            break
        used -= meta.size * len(meta.replicas_on(tier))
        if later and tiering.offload_later(state, meta, now):
            continue  # its DRAM comes back when the copy ends (not counted as an eviction)
        if tier is Tier.DRAM and state.mover is not None and not state.drop_evicts:
            if not tiering.offload(state, meta, now):
                state.delete(meta)
        else:
            state.delete(meta)
        evicted.append(meta.key)
    state.counters["evictions"] += len(evicted)
    return evicted


def evict_to_watermark(state: StateView) -> None:
    used, cap = usage(state, Tier.DRAM)
    if cap and used > cap * state.config.high_watermark:
        evict(state, Tier.DRAM)


def _evictable(m: ObjectMeta, now: float, tier: Tier, exclude: set[str] | None,
               moving: dict[str, int]) -> bool:  # fmt: skip
    if m.state is not ObjectState.COMPLETE or m.hard_pinned or m.leased(now) \
            or m.cooldown_until > now or m.key in moving:  # fmt: skip
        return False
    on_tier = m.replicas_on(tier)
    return bool(on_tier) and not (exclude and all(r.node_id in exclude for r in on_tier))

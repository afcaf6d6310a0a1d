"""DRAM <-> SSD moves decided by the master and carried out by the node holding both tiers.

An object evicted from a node's DRAM is offloaded to that node's SSD tier (when it has one,
making room there by dropping its coldest SSD objects) instead of being dropped; a get of an
object that lives only on SSD promotes it back to DRAM on the same node when there is room.
A moved object cools down for ``config.cooldown`` seconds: it is neither evicted nor promoted
again before then, so a hot-cold-hot pattern cannot make it bounce. The copy itself is the
node's RPC. With ``mover_async`` (the master's) both directions only start under the lock and
are applied when the copy ends (``_promoted``, ``_offloaded``): no get or put waits for a
node; a put that needs the DRAM an offload will free is told so (``MovesPending``). Without it
(pure tests) the synchronous ``mover`` copies at once. If a copy fails, the object stays where
it was (an offload that cannot even start means a plain eviction).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from kvpool.store.master.objects import ObjectMeta, ObjectState, Replica, Tier

if TYPE_CHECKING:
    from kvpool.store.master.view import MountedSegment, StateView


def segment_of(state: StateView, node_id: str, tier: Tier) -> MountedSegment | None:
    for seg in state.segments.values():
        if seg.node_id == node_id and seg.tier is tier and seg.ready:
            return seg
    return None


def offload(state: StateView, meta: ObjectMeta, now: float) -> bool:
    """Move ``meta``'s DRAM replicas to SSD on their nodes; False if it had to be dropped."""
    kept = [r for r in meta.replicas if r.tier is not Tier.DRAM]
    for src in meta.replicas_on(Tier.DRAM):
        dst = _ssd_space(state, src.node_id, meta.size, exclude=meta.key)
        if dst is not None and state.mover is not None and state.mover(src, dst, meta.size):
            kept.append(dst)
            state.on_move(meta, src, dst)
        else:
            if dst is not None:
                state.segments[dst.segment].allocator.free(dst.offset)
            # dropped, not moved: its node must forget it too (else the entry stays in the
            # node's index, and a master rebuilt from it after a fail-over adopts an object
            # whose bytes were reused: the acknowledged object put there since is refused)
            state.on_move(meta, src, None)
        state.free_replica(src)
    meta.replicas = kept
    meta.cooldown_until = now + state.config.cooldown
    if kept:
        state.counters["offloads"] += 1
    return bool(kept)


def promote(state: StateView, meta: ObjectMeta, now: float) -> None:
    """Bring an SSD-only object back to DRAM (same node) if nothing stands in the way. With
    ``state.mover_async`` the copy only starts here and ``_promoted`` applies it when it is
    done: the get that triggered it is served from SSD meanwhile."""
    if state.mover is None and state.mover_async is None:
        return
    if meta.replicas_on(Tier.DRAM) or meta.cooldown_until > now or meta.key in state.moving:
        return
    if state.mover_async is None and meta.leased(now):  # a reader may be on the SSD copy
        return
    for src in meta.replicas_on(Tier.SSD):
        dram = segment_of(state, src.node_id, Tier.DRAM)
        offset = dram.allocator.allocate(meta.size) if dram is not None else None
        if offset is None:
            continue
        dst = Replica(src.node_id, dram.name, offset, Tier.DRAM)
        meta.cooldown_until = now + state.config.cooldown
        if state.mover_async is not None:
            _begin(state, meta.key)
            segs = (state.segments.get(src.segment), dram)
            state.mover_async(src, dst, meta.size, functools.partial(_promoted, state, meta, src,
                                                                     dst, segs))  # fmt: skip
            return
        assert state.mover is not None
        if not state.mover(src, dst, meta.size):
            dram.allocator.free(offset)
            meta.cooldown_until = 0.0
            continue
        _swap(state, meta, src, dst, now)
        state.counters["promotions"] += 1
        return


def _promoted(state: StateView, meta: ObjectMeta, src: Replica, dst: Replica, segs: tuple,
              ok: bool) -> None:  # fmt: skip
    """A promotion's copy ended (the state's lock is held): swap the replicas if the object is
    still the one copied, else give the DRAM range back."""
    if _applies(state, meta, src, dst, segs, ok):
        _swap(state, meta, src, dst, state.clock())
        state.counters["promotions"] += 1


def offload_later(state: StateView, meta: ObjectMeta, now: float) -> bool:
    """Start moving ``meta``'s DRAM replicas to SSD on their nodes (``state.mover_async``);
    their DRAM goes when the copies end (``_offloaded``). False if none could start."""
    started = False
    for src in meta.replicas_on(Tier.DRAM):
        dst = _ssd_space(state, src.node_id, meta.size, exclude=meta.key)
        if dst is None:
            continue
        _begin(state, meta.key)
        started = True
        assert state.mover_async is not None
        segs = (state.segments.get(src.segment), state.segments.get(dst.segment))
        state.mover_async(src, dst, meta.size, functools.partial(_offloaded, state, meta, src,
                                                                 dst, segs))  # fmt: skip
    if started:
        meta.cooldown_until = now + state.config.cooldown
    return started


def _offloaded(state: StateView, meta: ObjectMeta, src: Replica, dst: Replica, segs: tuple,
               ok: bool) -> None:  # fmt: skip
    """An offload's copy ended (the state's lock is held): the object now lives on SSD, its
    DRAM is free; if the copy failed it simply stays in DRAM."""
    if _applies(state, meta, src, dst, segs, ok):
        _swap(state, meta, src, dst, state.clock())
        state.counters["offloads"] += 1


def _begin(state: StateView, key: str) -> None:
    state.moving[key] = state.moving.get(key, 0) + 1


def _applies(state: StateView, meta: ObjectMeta, src: Replica, dst: Replica, segs: tuple,
             ok: bool) -> bool:  # fmt: skip
    """Whether a finished copy is still wanted; if not, its destination range goes back. The
    segments must be the very ones the copy started between (``segs``): a node that mounted
    again meanwhile has new allocators under the same names."""
    left = state.moving.get(meta.key, 1) - 1
    if left > 0:
        state.moving[meta.key] = left
    else:
        state.moving.pop(meta.key, None)
    src_seg, dst_seg = segs
    same_dst = dst_seg is not None and state.segments.get(dst.segment) is dst_seg
    if ok and same_dst and state.segments.get(src.segment) is src_seg \
            and state.objects.get(meta.key) is meta and meta.state is ObjectState.COMPLETE \
            and any(r is src for r in meta.replicas):  # fmt: skip
        return True
    if same_dst:
        dst_seg.allocator.free(dst.offset)
    return False


def _swap(state: StateView, meta: ObjectMeta, src: Replica, dst: Replica, now: float) -> None:
    meta.replicas = [dst if r is src else r for r in meta.replicas]
    if meta.leased(now):  # a reader may still be on the old copy: free it when its lease ends
        state.retired.append((src, meta.lease_until))
    else:
        state.free_replica(src)
    state.on_move(meta, src, dst)


def _ssd_space(state: StateView, node_id: str, size: int, exclude: str) -> Replica | None:
    """An SSD range on ``node_id``, dropping that node's coldest SSD objects if needed."""
    ssd = segment_of(state, node_id, Tier.SSD)
    if ssd is None or size > ssd.allocator.capacity:
        return None
    offset = ssd.allocator.allocate(size)
    if offset is None:
        now = state.clock()
        victims = sorted(
            (
                m for m in state.objects.values()
                if m.key != exclude and m.state is ObjectState.COMPLETE and not m.leased(now)
                and any(r.segment == ssd.name for r in m.replicas)
            ),
            key=lambda m: m.eviction_order(now, state.config.half_life),
        )  # fmt: skip
        for victim in victims:
            state.drop_replicas(victim, ssd.name)
            offset = ssd.allocator.allocate(size)
            if offset is not None:
                break
    return None if offset is None else Replica(node_id, ssd.name, offset, Tier.SSD)

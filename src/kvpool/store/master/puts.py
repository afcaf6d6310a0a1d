"""The two-phase put (functions over a ``StateView``): start, end, revoke, expire; upserts.

``start`` allocates replicas and records the object PROCESSING under a random put id that only
the putting client learns; ``end`` with that id and the value's checksum makes it COMPLETE;
``revoke`` (or the deadline) frees the space. An *upsert* of an existing key allocates the new
version beside the old one, which stays readable until the new one ends; then the new one is
the key's, and the old one's replicas are freed once no read lease covers them any more (a
reader that got them keeps reading the bytes it was promised).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from kvpool.common.errors import (
    AlreadyExistsError,
    BackpressureError,
    BadRequestError,
    NotFoundError,
    PutInProgressError,
)
from kvpool.config import MAX_REPLICAS
from kvpool.store.master import placement
from kvpool.store.master.objects import ObjectMeta, ObjectState, PutOptions

if TYPE_CHECKING:
    from kvpool.store.master.view import StateView

MAX_KEY_BYTES = 4096


def start(state: StateView, key: str, size: int, replicas: int | None, owner: str,
          opts: PutOptions) -> ObjectMeta:  # fmt: skip
    """Allocate ``replicas`` copies on distinct nodes for client ``owner``."""
    _check_key(key)
    cfg = state.config
    want = cfg.replicas if replicas is None else replicas
    if not _is_int(want) or not 1 <= want <= MAX_REPLICAS:
        raise BadRequestError(f"replicas must be an integer in [1, {MAX_REPLICAS}]")
    if not _is_int(size) or not 0 < size <= cfg.max_object_bytes:
        raise BadRequestError(f"value size {size} not in [1, {cfg.max_object_bytes}] bytes")
    old = state.objects.get(key)
    if key in state.upserts or (old is not None and old.state is ObjectState.PROCESSING):
        raise PutInProgressError(f"a put of key {key!r} is in progress")
    if old is not None and not opts.upsert and not state.on_suspect_nodes(old):
        raise AlreadyExistsError(f"key {key!r} already exists (objects are immutable)")
    # an upsert, or a put of a key whose nodes may be gone: a real put, which replaces the old
    # version when it ends (a put that fails leaves the old one as it was)
    held = state.pending_bytes.get(owner, 0)
    if held + size * want > cfg.max_pending_bytes:
        raise BackpressureError(
            f"client {owner} has {held} bytes in unfinished puts (at most "
            f"{cfg.max_pending_bytes}): end or revoke them first"
        )
    placed = placement.place(state, size, want, opts.preferred)
    now = state.clock()
    deadline = now + cfg.put_timeout + size / cfg.put_min_rate
    meta = ObjectMeta(key, size, placed, now, put_deadline=deadline,
                      put_id=secrets.randbits(63) or 1, owner=owner,
                      pending=size * len(placed))  # fmt: skip
    meta.pinned, meta.hard_pinned = opts.soft_pin, opts.hard_pin
    if opts.soft_pin and opts.pin_ttl is not None:
        meta.pin_until = now + opts.pin_ttl
    state.pending_bytes[owner] += meta.pending
    if old is None:
        state.objects[key] = meta
    else:
        state.upserts[key] = meta
    state.counters["puts"] += 1
    return meta


def end(state: StateView, key: str, put_id: int, checksum: int) -> ObjectMeta:
    """The put ``put_id`` of ``key`` is COMPLETE (with the value's 64-bit ``checksum``)."""
    meta = in_progress(state, key, put_id)
    if not _is_int(checksum) or not 0 <= checksum < 1 << 64:
        raise BadRequestError("checksum must be an unsigned 64-bit integer")
    state.settle(meta)
    now = state.clock()
    if state.upserts.get(key) is meta:  # the new version takes the key; the old one retires
        del state.upserts[key]
        old = state.objects.get(key)
        if old is not None:
            state.retire(old, now)
        state.objects[key] = meta
    meta.state = ObjectState.COMPLETE
    meta.checksum = checksum
    meta.touch(now, state.config.half_life)
    return meta


def revoke(state: StateView, meta: ObjectMeta) -> None:
    state.delete(meta)
    state.counters["revokes"] += 1


def expire(state: StateView, now: float) -> list[str]:
    """Revoke the puts past their deadline; their keys."""
    late = [m for m in (*state.objects.values(), *state.upserts.values())
            if m.state is ObjectState.PROCESSING and m.put_deadline < now]  # fmt: skip
    for meta in late:
        revoke(state, meta)
    return [m.key for m in late]


def in_progress(state: StateView, key: str, put_id: int) -> ObjectMeta:
    """The unfinished put ``put_id`` of ``key`` (a plain put or an upsert)."""
    for meta in (state.objects.get(key), state.upserts.get(key)):
        if meta is not None and meta.state is ObjectState.PROCESSING and meta.put_id == put_id:
            return meta
    raise NotFoundError(f"no put {put_id!r} in progress for key {key!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise BadRequestError("a key must be a non-empty string")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise BadRequestError(f"a key must be at most {MAX_KEY_BYTES} bytes")

"""The store client: metadata from the master over RPC, bytes through the transfer engine.

A put is two-phase: ``put_start`` (the master allocates replicas and hands out a put id),
WRITE the bytes into every replica's segment, ``put_end`` with that id and the value's checksum
(or ``put_revoke`` if a write failed). A get asks the master (which grants a read lease), READs
one replica straight into the destination, and verifies the checksum, trying the next replica
on any failure: a get returns the bytes that were put, or raises ``NotFoundError``; never other
bytes.

The checksum is xxh3-64 of the value (it catches accidents) in an open cluster, and a keyed
BLAKE3 MAC of the key and the value (64-bit tag, key derived from the cluster token) when the
cluster has a token: then bytes written into a segment by anyone without the token, or moved
from another key, are a miss, never a hit.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import blake3
import xxhash

from kvpool.common import auth
from kvpool.common.errors import KVPoolError, NotFoundError, TransferError
from kvpool.common.rpc import error_from_body
from kvpool.config import TransferConfig
from kvpool.store.lease_cache import LeaseCache
from kvpool.store.link import MasterLink
from kvpool.transfer import Op, TransferEngine, TransferRequest
from kvpool.transfer.metadata import directory_for
from kvpool.transfer.segment import byte_view

logger = logging.getLogger(__name__)


BATCH = 4096  # keys per master call of a batch (the RPC's bulk limits allow 65,536 elements)
_MAC_THREADS_FROM = 512 << 10


def checksum(view) -> int:
    """xxh3-64 of the value (about 20 µs per MiB here, 4x cheaper than xxh64)."""
    return xxhash.xxh3_64_intdigest(view)


def checksum_parts(parts: list, key: str = "", mac_key: bytes | None = None) -> int:
    """The checksum of the concatenation of ``parts``: xxh3-64 (equal to ``checksum`` of the
    whole), or with ``mac_key`` the first 64 bits of keyed BLAKE3 over ``key`` and the value."""
    if mac_key is not None:
        encoded = key.encode()
        big = sum(len(p) for p in parts) >= _MAC_THREADS_FROM  # then on every core: 2x here
        h = blake3.blake3(len(encoded).to_bytes(4, "little") + encoded, key=mac_key,
                          max_threads=blake3.blake3.AUTO if big else 1)  # fmt: skip
        for p in parts:
            h.update(p)
        return int.from_bytes(h.digest(8), "little")
    if len(parts) == 1:
        return checksum(parts[0])
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def _requests(op: Op, parts: list, replica: dict, engine: TransferEngine) -> list[TransferRequest]:
    """One request per part, at consecutive offsets of the replica (``engine`` forgets a cached
    descriptor of its segment that another owner published: a node that restarted)."""
    if replica.get("owner"):
        engine.expect_owner(replica["segment"], replica["owner"])
    out, off = [], replica["offset"]
    for p in parts:
        out.append(TransferRequest(op, p, replica["segment"], off))
        off += len(p)
    return out


def transfer_config(config: TransferConfig | None, token: str | None,
                    master: str | None = None) -> TransferConfig:  # fmt: skip
    """``config`` (default: a fresh one) with ``token`` as its auth token unless it has one,
    and ``master``'s segment directory unless it names one."""
    config = config or TransferConfig(auth_token=token or None)
    changes: dict = {}
    if token and config.auth_token is None:
        changes["auth_token"] = token
    if config.directory is None and master:
        changes["directory"] = directory_for(master)
    return dataclasses.replace(config, **changes) if changes else config


class StoreClient:
    """Pythonic access to the pool: put/get (+ zero-copy ``put_from``/``get_into``) and batches.

    ``token``: the cluster token (None: from the environment); ``admin_token``: connect to the
    master as an admin (needed for ``remove(force=True)``).
    """

    def __init__(
        self,
        master: str,
        transfer: TransferEngine | TransferConfig | None = None,
        token: str | None = None,
        timeout: float = 10.0,
        lease_cache: bool = True,
        admin_token: str | None = None,
    ) -> None:
        token = auth.cluster_token(token)
        self._own_engine = not isinstance(transfer, TransferEngine)
        self.engine = transfer if isinstance(transfer, TransferEngine) else \
            TransferEngine(transfer_config(transfer, token, master))  # fmt: skip
        self.master = MasterLink(master, token=token or "", timeout=timeout,
                                 admin_token=admin_token)  # fmt: skip
        self.timeout = timeout
        self._mac_key = auth.derive_key(token, auth.KV_MAC) if token else None
        self.leases = LeaseCache(lease_cache)  # repeated reads within a lease skip the master

    # -- single ---------------------------------------------------------------------------------

    def put(self, key: str, value, replicas: int | None = None) -> None:
        """Store ``value`` (bytes, bytearray, memoryview, numpy array or CPU tensor) under
        ``key``; ``AlreadyExistsError`` if the key exists (objects are immutable)."""
        view = byte_view(value, writable=False)
        meta = self.master.call("put_start", key, len(view), replicas)
        self._write(meta, view)
        self.master.call("put_end", key, meta["put_id"], self._checksum(key, [view]))

    put_from = put  # values are never copied on the way out: the engine sends from the buffer

    def get(self, key: str) -> bytes:
        """The value of ``key``; ``NotFoundError`` if it does not exist."""
        for fresh in (False, True):
            meta, cached = self._meta(key, fresh)
            buf = bytearray(meta["size"])
            try:
                self._read(meta, memoryview(buf))
                return bytes(buf)
            except NotFoundError:
                if not cached:
                    raise
                self.leases.drop(key)
        raise AssertionError("unreachable")

    def get_into(self, key: str, buffer) -> int:
        """Read ``key`` straight into ``buffer`` (at least its size); the number of bytes."""
        view = byte_view(buffer, writable=True)
        for fresh in (False, True):
            meta, cached = self._meta(key, fresh)
            if meta["size"] > len(view):
                raise KVPoolError(f"buffer of {len(view)} bytes too small for {meta['size']}")
            try:
                self._read(meta, view[: meta["size"]])
                return meta["size"]
            except NotFoundError:
                if not cached:
                    raise
                self.leases.drop(key)
        raise AssertionError("unreachable")

    def _meta(self, key: str, fresh: bool = False) -> tuple[dict, bool]:
        """(the object's replicas, whether they came from a lease this client holds)."""
        meta = None if fresh else self.leases.get(key)
        if meta is not None:
            return meta, True
        asked = time.monotonic()
        meta = self.master.call("get", key)
        self.leases.put(key, meta, asked)
        return meta, False

    def _batch_metas(self, keys: list[str]) -> tuple[list, list[bool]]:
        metas = [self.leases.get(k) for k in keys]
        cached = [m is not None for m in metas]
        missing = [i for i, m in enumerate(metas) if m is None]
        if missing:
            asked = time.monotonic()
            got = self._batched("batch_get", [keys[i] for i in missing])
            for i, m in zip(missing, got, strict=True):
                metas[i] = m
                self.leases.put(keys[i], m, asked)
        return metas, cached

    def _checksum(self, key: str, parts: list) -> int:
        return checksum_parts(parts, key, self._mac_key)

    def _verified(self, meta: dict, parts: list) -> bool:
        want = meta["checksum"]
        return want is not None and self._checksum(meta["key"], parts) == want

    def get_size(self, key: str) -> int:
        return int(self._meta(key)[0]["size"])

    def exists(self, key: str) -> bool:
        return bool(self.master.call("exists", key))

    def batch_exists(self, keys: list[str]) -> list[bool]:
        return self._batched("batch_exists", keys)

    def _batched(self, method: str, items: list, *args) -> list:
        """A batch call cut into master calls of at most ``BATCH`` items."""
        out: list = []
        for i in range(0, len(items), BATCH):
            out.extend(self.master.call(method, items[i : i + BATCH], *args))
        return out

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``; ``force`` (ignore readers' leases) needs the admin token."""
        self.leases.drop(key)
        self.master.call("remove", key, force)

    def stats(self) -> dict:
        return self.master.call("stats")

    # -- batches --------------------------------------------------------------------------------

    def batch_put(self, keys: list[str], values: list, replicas: int | None = None) -> list:
        """Put many; per key None on success or the ``KVPoolError`` that stopped it."""
        return self.batch_put_parts(keys, [[v] for v in values], replicas)

    def batch_put_parts(self, keys: list[str], values: list[list], replicas: int | None = None):
        """``batch_put`` of values given as lists of buffers, stored as their concatenation
        (each part is sent from where it is: e.g. a header and a slice of a KV tensor)."""
        parts = [[byte_view(p, writable=False) for p in v] for v in values]
        sizes = [sum(len(p) for p in ps) for ps in parts]
        items = [[k, n] for k, n in zip(keys, sizes, strict=True)]
        metas = self._batched("batch_put_start", items, replicas)
        results: list = [None] * len(keys)
        reqs, owners = [], []
        for i, (meta, ps) in enumerate(zip(metas, parts, strict=True)):
            if "error" in meta:
                results[i] = error_from_body(meta["error"])
                continue
            for r in meta["replicas"]:
                batch = _requests(Op.WRITE, ps, r, self.engine)
                reqs.extend(batch)
                owners.extend([i] * len(batch))
        try:
            statuses = self.engine.transfer_statuses(reqs, self.timeout) if reqs else []
        except KVPoolError as exc:  # e.g. a replica's segment cannot be resolved: none moved
            statuses = []
            for i in set(owners):
                results[i] = exc
        for i, status in zip(owners if statuses else [], statuses, strict=True):
            if not status.ok and results[i] is None:
                results[i] = status.error
        ends = [[keys[i], metas[i]["put_id"], self._checksum(keys[i], parts[i])]
                for i in range(len(keys)) if results[i] is None]  # fmt: skip
        failed = [[keys[i], metas[i]["put_id"]]
                  for i in range(len(keys)) if results[i] is not None and "error" not in metas[i]]  # fmt: skip
        if failed:
            self._revoke_many(failed)
        if ends:
            self._batched("batch_put_end", ends)
        return results

    batch_put_from = batch_put

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        """Values of many keys (None for a missing one)."""
        bufs: dict[int, bytearray] = {}

        def views_for(meta: dict, i: int) -> list:
            bufs[i] = bytearray(meta["size"])
            return [memoryview(bufs[i])]

        _, ok = self._batch_read(keys, views_for)
        return [bytes(bufs[i]) if good else None for i, good in enumerate(ok)]

    def batch_get_into(self, keys: list[str], buffers: list) -> list[int]:
        """Read many straight into buffers; per key the size read, or -1 when missing."""
        views = [byte_view(b, writable=True) for b in buffers]

        def views_for(meta: dict, i: int) -> list | None:
            return [views[i][: meta["size"]]] if meta["size"] <= len(views[i]) else None

        metas, ok = self._batch_read(keys, views_for)
        return [m["size"] if good else -1 for m, good in zip(metas, ok, strict=True)]

    def batch_get_into_parts(self, keys: list[str], buffers: list[list]) -> list[int]:
        """Read many, each into a list of buffers that together are exactly its size (e.g. a
        header buffer and a slice of a KV tensor); per key the size read, or -1."""
        parts = [[byte_view(b, writable=True) for b in bs] for bs in buffers]

        def views_for(meta: dict, i: int) -> list | None:
            return parts[i] if meta["size"] == sum(len(p) for p in parts[i]) else None

        metas, ok = self._batch_read(keys, views_for)
        return [m["size"] if good else -1 for m, good in zip(metas, ok, strict=True)]

    def _batch_read(self, keys: list[str], views_for) -> tuple[list, list[bool]]:
        """Read many (``views_for(meta, i)``: where object ``i`` goes, or None to skip it);
        reads that relied on a cached lease and failed are retried once with fresh replicas."""
        metas, cached = self._batch_metas(keys)
        views = [views_for(m, i) if m else None for i, m in enumerate(metas)]
        ok = self._read_many(metas, views)
        stale = [i for i, (c, good) in enumerate(zip(cached, ok, strict=True)) if c and not good]
        if stale:
            asked = time.monotonic()
            fresh = self._batched("batch_get", [keys[i] for i in stale])
            for i, m in zip(stale, fresh, strict=True):
                self.leases.drop(keys[i])
                self.leases.put(keys[i], m, asked)
                metas[i], views[i] = m, (views_for(m, i) if m else None)
            again = self._read_many([metas[i] for i in stale], [views[i] for i in stale])
            for i, good in zip(stale, again, strict=True):
                ok[i] = good
        return metas, ok

    # -- data path ------------------------------------------------------------------------------

    def _write(self, meta: dict, view: memoryview) -> None:
        reqs = [
            req for r in meta["replicas"] for req in _requests(Op.WRITE, [view], r, self.engine)
        ]
        try:
            self.engine.transfer(reqs, timeout=self.timeout)
        except KVPoolError:
            self._revoke_many([[meta["key"], meta["put_id"]]])
            raise

    def _revoke_many(self, items: list[list]) -> None:
        """Revoke puts ``[[key, put_id], ...]`` whose writes failed (best effort: the master
        revokes them at their deadline anyway)."""
        try:
            self._batched("batch_put_revoke", items)
        except KVPoolError as exc:
            logger.warning("store: revoking %d puts failed: %s", len(items), exc)

    def _read(self, meta: dict, view) -> None:
        parts = view if isinstance(view, list) else [view]
        last: Exception | None = None
        for r in meta["replicas"]:
            try:
                self.engine.transfer(_requests(Op.READ, parts, r, self.engine))
            except KVPoolError as exc:
                last = exc
                continue
            if self._verified(meta, parts):
                return
            last = TransferError(f"checksum mismatch reading {meta['key']} from {r['node']}")
        raise NotFoundError(f"key {meta['key']!r}: no readable replica ({last})")

    def _read_many(self, metas: list, views: list) -> list[bool]:
        """One batch of READs from each object's first replica; stragglers retried singly.
        ``views[i]`` is the list of buffers object ``i`` is read into (None: skip it)."""
        picks = [(i, m) for i, m in enumerate(metas) if m and views[i] is not None]
        reqs, owners = [], []
        for i, m in picks:
            batch = _requests(Op.READ, views[i], m["replicas"][0], self.engine)
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
            if moved[i] and self._verified(m, views[i]):
                ok[i] = True
                continue
            try:
                self._read(m, views[i])
                ok[i] = True
            except NotFoundError:
                pass
        return ok

    def close(self) -> None:
        self.master.close()
        if self._own_engine:
            self.engine.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

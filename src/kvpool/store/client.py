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

from kvpool.common import auth
from kvpool.common.errors import KVPoolError, NotFoundError, RoomPendingError
from kvpool.common.rpc import error_from_body
from kvpool.config import TransferConfig
from kvpool.protocol.store import ObjectDesc, PutOptions
from kvpool.store.lease_cache import LeaseCache
from kvpool.store.link import MasterLink
from kvpool.store.replica_io import ReplicaIO, requests
from kvpool.transfer import Op, TransferEngine
from kvpool.transfer.metadata import directory_for
from kvpool.transfer.segment import byte_view

logger = logging.getLogger(__name__)


BATCH = 4096  # keys per master call of a batch (the RPC's bulk limits allow 65,536 elements)
ROOM_RETRY_S = 0.02  # between tries of a put that waits for offloads to make room


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
        failover_timeout: float = 15.0,
    ) -> None:
        token = auth.cluster_token(token)
        self._own_engine = not isinstance(transfer, TransferEngine)
        self.engine = transfer if isinstance(transfer, TransferEngine) else \
            TransferEngine(transfer_config(transfer, token, master))  # fmt: skip
        # with etcd://, calls ride through a master fail-over for up to ``failover_timeout``
        self.master = MasterLink(master, token=token or "", timeout=timeout,
                                 failover_timeout=failover_timeout, admin_token=admin_token,
                                 spin=self.engine.config.spin_us * 1e-6)  # fmt: skip
        self.timeout = timeout
        mac_key = auth.derive_key(token, auth.KV_MAC) if token else None
        self.io = ReplicaIO(self.engine, timeout, mac_key, self._report_unreachable)
        self._reported: dict[str, float] = {}  # node -> when this client last reported it
        self.leases = LeaseCache(lease_cache)  # repeated reads within a lease skip the master

    # -- single ---------------------------------------------------------------------------------

    def put(self, key: str, value, replicas: int | None = None, *,
            options: PutOptions | None = None) -> None:  # fmt: skip
        """Store ``value`` (bytes, bytearray, memoryview, numpy array or CPU tensor) under
        ``key``; ``AlreadyExistsError`` if the key exists (objects are immutable) unless
        ``options.upsert``; ``options`` also names preferred nodes and pins."""
        view = byte_view(value, writable=False)
        wire = options.to_wire() if options is not None else None
        deadline = time.monotonic() + self.timeout
        sums: list[int] = []  # the checksum, computed while the master allots the replicas

        def checksum() -> None:
            if not sums:
                sums.append(self.io.checksum(key, [view]))

        while True:
            try:
                meta = ObjectDesc.from_wire(self.master.call(
                    "put_start", key, len(view), replicas, wire, meanwhile=checksum))  # fmt: skip
                break
            except RoomPendingError:  # offloads are making room: ask again in a moment
                if time.monotonic() > deadline:
                    raise
                time.sleep(ROOM_RETRY_S)
        try:
            self.io.write(meta, [view])
        except KVPoolError:
            self._revoke_many([[key, meta.put_id]])
            raise
        checksum()
        self.master.call("put_end", key, meta.put_id, sums[0])

    put_from = put  # values are never copied on the way out: the engine sends from the buffer

    def get(self, key: str) -> bytes:
        """The value of ``key``; ``NotFoundError`` if it does not exist."""
        for fresh in (False, True):
            meta, cached = self._meta(key, fresh)
            buf = bytearray(meta.size)
            try:
                self.io.read(meta, [memoryview(buf)])
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
            if meta.size > len(view):
                raise KVPoolError(f"buffer of {len(view)} bytes too small for {meta.size}")
            try:
                self.io.read(meta, [view[: meta.size]])
                return meta.size
            except NotFoundError:
                if not cached:
                    raise
                self.leases.drop(key)
        raise AssertionError("unreachable")

    def _meta(self, key: str, fresh: bool = False) -> tuple[ObjectDesc, bool]:
        """(the object's replicas, whether they came from a lease this client holds)."""
        meta = None if fresh else self.leases.get(key)
        if meta is not None:
            return meta, True
        asked = time.monotonic()
        meta = ObjectDesc.from_wire(self.master.call("get", key))
        self.leases.put(key, meta, asked)
        return meta, False

    def _batch_metas(self, keys: list[str]) -> tuple[list, list[bool]]:
        metas = [self.leases.get(k) for k in keys]
        cached = [m is not None for m in metas]
        missing = [i for i, m in enumerate(metas) if m is None]
        if missing:
            asked = time.monotonic()
            got = self._descs("batch_get", [keys[i] for i in missing])
            for i, m in zip(missing, got, strict=True):
                metas[i] = m
                self.leases.put(keys[i], m, asked)
        return metas, cached

    def get_size(self, key: str) -> int:
        return self._meta(key)[0].size

    def exists(self, key: str) -> bool:
        return bool(self.master.call("exists", key))

    def batch_exists(self, keys: list[str]) -> list[bool]:
        return self._batched("batch_exists", keys)

    def batch_tiers(self, keys: list[str]) -> list[str | None]:
        """Per key the tier a read would come from ("dram", "ssd"), or None when missing."""
        return self._batched("batch_tiers", keys)

    def _put_starts(self, items: list, replicas: int | None, wire, meanwhile=None) -> list:
        """``batch_put_start``: per item the started put (an ``ObjectDesc``) or the
        ``KVPoolError`` that refused it, asking again for the items that got
        ``RoomPendingError`` (offloads are making room) until ``timeout`` passes
        (``meanwhile``: see ``RpcClient.call``)."""
        metas = self._started(self._batched("batch_put_start", items, replicas, wire,
                                            meanwhile=meanwhile))  # fmt: skip
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            again = [i for i, m in enumerate(metas) if isinstance(m, RoomPendingError)]
            if not again:
                break
            time.sleep(ROOM_RETRY_S)
            for i, m in zip(again, self._started(self._batched(
                    "batch_put_start", [items[i] for i in again], replicas, wire)), strict=True):  # fmt: skip
                metas[i] = m
        return metas

    @staticmethod
    def _started(answers: list) -> list:
        return [error_from_body(a["error"]) if isinstance(a, dict) and "error" in a
                else ObjectDesc.from_wire(a) for a in answers]  # fmt: skip

    def _descs(self, method: str, keys: list[str]) -> list[ObjectDesc | None]:
        return [ObjectDesc.maybe(m) for m in self._batched(method, keys)]

    def _batched(self, method: str, items: list, *args, meanwhile=None) -> list:
        """A batch call in master calls of at most ``BATCH`` items (``meanwhile``: the first's)."""
        out: list = []
        for i in range(0, len(items), BATCH):
            out.extend(self.master.call(method, items[i : i + BATCH], *args,
                                        meanwhile=meanwhile if i == 0 else None))  # fmt: skip
        return out

    def upsert(self, key: str, value, replicas: int | None = None) -> None:
        """Store ``value`` under ``key``, replacing what is there (readers holding a lease on
        the old value keep reading it; new reads get the new one)."""
        self.leases.drop(key)
        self.put(key, value, replicas, options=PutOptions(upsert=True))

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``; ``force`` (ignore readers' leases) needs the admin token."""
        self.leases.drop(key)
        self.master.call("remove", key, force)

    def remove_matching(self, pattern: str | None = None, force: bool = False) -> int:
        """Remove every object whose key matches ``pattern`` (``re.search``; None: all),
        but those a reader holds a lease on unless ``force``; how many went."""
        self.leases.clear()
        return int(self.master.call("remove_matching", pattern, force))

    def replicas(self, key: str) -> ObjectDesc | None:
        """Where ``key``'s replicas are (node, segment, offset, tier, owner), or None."""
        return ObjectDesc.maybe(self.master.call("replicas", key))

    def get_ranges(self, key: str, ranges: list[tuple[int, object]]) -> int:
        """Read byte ranges of ``key``: ``[(offset in the value, destination buffer), ...]``
        (each buffer is filled from that offset); the value's size. Partial reads cannot be
        checked against the value's checksum: only whole values are."""
        meta, _ = self._meta(key)
        self.io.read_ranges(meta, [(off, byte_view(buf, writable=True)) for off, buf in ranges])
        return meta.size

    def stats(self) -> dict:
        return self.master.call("stats")

    # -- batches --------------------------------------------------------------------------------

    def batch_put(self, keys: list[str], values: list, replicas: int | None = None, *,
                  options: PutOptions | None = None) -> list:  # fmt: skip
        """Put many; per key None on success or the ``KVPoolError`` that stopped it."""
        return self.batch_put_parts(keys, [[v] for v in values], replicas, options=options)

    def batch_put_parts(self, keys: list[str], values: list[list], replicas: int | None = None,
                        *, options: PutOptions | None = None):  # fmt: skip
        """``batch_put`` of values given as lists of buffers, stored as their concatenation
        (each part is sent from where it is: e.g. a header and a slice of a KV tensor)."""
        parts = [[byte_view(p, writable=False) for p in v] for v in values]
        sizes = [sum(len(p) for p in ps) for ps in parts]
        items = [[k, n] for k, n in zip(keys, sizes, strict=True)]
        if options is not None and options.upsert:
            for k in keys:
                self.leases.drop(k)
        wire = options.to_wire() if options is not None else None
        sums: list[int] = []  # checksums, computed while the master allots the replicas

        def checksums() -> None:
            if not sums:
                sums.extend(self.io.checksum(k, ps) for k, ps in zip(keys, parts, strict=True))

        metas = self._put_starts(items, replicas, wire, checksums)
        checksums()
        results: list = [None] * len(keys)
        reqs, owners = [], []
        for i, (meta, ps) in enumerate(zip(metas, parts, strict=True)):
            if isinstance(meta, KVPoolError):
                results[i] = meta
                continue
            try:
                batch = [q for r in meta.replicas for q in requests(Op.WRITE, ps, r, self.engine)]
            except KVPoolError as exc:  # this item only (its put is revoked below)
                results[i] = exc
                continue
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
        ends = [[keys[i], metas[i].put_id, sums[i]] for i in range(len(keys)) if results[i] is None]
        failed = [[keys[i], metas[i].put_id] for i in range(len(keys))
                  if results[i] is not None and isinstance(metas[i], ObjectDesc)]  # fmt: skip
        if failed:
            self._revoke_many(failed)
        if ends:
            acked = self._batched("batch_put_end", ends)
            done = [i for i in range(len(keys)) if results[i] is None]
            for i, ok in zip(done, acked, strict=True):
                if not ok:  # its put expired meanwhile (revoked at its deadline): not stored
                    results[i] = KVPoolError(f"put of {keys[i]!r} expired before it ended")
        return results

    batch_put_from = batch_put

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        """Values of many keys (None for a missing one)."""
        return [None if b is None else bytes(b) for b in self.batch_get_as(keys, bytearray)]

    def batch_get_as(self, keys: list[str], make) -> list:
        """Values of many keys, each read into a new ``make(size)`` (a writable buffer, e.g.
        ``bytearray``); None for a missing one."""
        bufs: dict[int, object] = {}

        def views_for(meta: ObjectDesc, i: int) -> list:
            bufs[i] = make(meta.size)
            return [memoryview(bufs[i])]  # type: ignore[arg-type]

        _, ok = self._batch_read(keys, views_for)
        return [bufs[i] if good else None for i, good in enumerate(ok)]

    def batch_get_into(self, keys: list[str], buffers: list) -> list[int]:
        """Read many straight into buffers; per key the size read, or -1 when missing."""
        views = [byte_view(b, writable=True) for b in buffers]

        def views_for(meta: ObjectDesc, i: int) -> list | None:
            return [views[i][: meta.size]] if meta.size <= len(views[i]) else None

        metas, ok = self._batch_read(keys, views_for)
        return [m.size if good else -1 for m, good in zip(metas, ok, strict=True)]

    def batch_get_into_parts(self, keys: list[str], buffers: list[list]) -> list[int]:
        """Read many, each into a list of buffers that together are exactly its size (e.g. a
        header buffer and a slice of a KV tensor); per key the size read, or -1."""
        parts = [[byte_view(b, writable=True) for b in bs] for bs in buffers]

        def views_for(meta: ObjectDesc, i: int) -> list | None:
            return parts[i] if meta.size == sum(len(p) for p in parts[i]) else None

        metas, ok = self._batch_read(keys, views_for)
        return [m.size if good else -1 for m, good in zip(metas, ok, strict=True)]

    def _batch_read(self, keys: list[str], views_for) -> tuple[list, list[bool]]:
        """Read many (``views_for(meta, i)``: where object ``i`` goes, or None to skip it);
        reads that relied on a cached lease and failed are retried once with fresh replicas."""
        metas, cached = self._batch_metas(keys)
        views = [views_for(m, i) if m else None for i, m in enumerate(metas)]
        ok = self.io.read_many(metas, views)
        stale = [i for i, (c, good) in enumerate(zip(cached, ok, strict=True)) if c and not good]
        if stale:
            asked = time.monotonic()
            fresh = self._descs("batch_get", [keys[i] for i in stale])
            for i, m in zip(stale, fresh, strict=True):
                self.leases.drop(keys[i])
                self.leases.put(keys[i], m, asked)
                metas[i], views[i] = m, (views_for(m, i) if m else None)
            again = self.io.read_many([metas[i] for i in stale], [views[i] for i in stale])
            for i, good in zip(stale, again, strict=True):
                ok[i] = good
        return metas, ok

    def _report_unreachable(self, nodes: list[str]) -> None:
        """Tell the master (at most twice a second per node) that reads from ``nodes`` failed:
        a node that died is then not trusted until it heartbeats again (best effort)."""
        now = time.monotonic()
        fresh = [n for n in dict.fromkeys(nodes) if now - self._reported.get(n, -1.0) >= 0.5]
        if not fresh:
            return
        self._reported.update(dict.fromkeys(fresh, now))
        try:
            self.master.call("report_unreachable", fresh)
        except KVPoolError as exc:
            logger.debug("store: reporting %s unreachable failed: %s", fresh, exc)

    def _revoke_many(self, items: list[list]) -> None:
        """Revoke puts ``[[key, put_id], ...]`` whose writes failed (best effort: the master
        revokes them at their deadline anyway)."""
        try:
            self._batched("batch_put_revoke", items)
        except KVPoolError as exc:
            logger.warning("store: revoking %d puts failed: %s", len(items), exc)

    def close(self) -> None:
        self.master.close()
        if self._own_engine:
            self.engine.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The master as an RPC service: ``MasterState`` behind one lock, plus a ticker thread.

Nodes learn what they hold through their heartbeats: every committed or deleted replica is
queued for its node and handed over with the next heartbeat reply, so each node keeps an index
of its own contents and a fresh master can rebuild the object table from the nodes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvpool.common.errors import (
    BadRequestError,
    KVPoolError,
    NoSpaceError,
    NotFoundError,
    UnavailableError,
)
from kvpool.common.rpc import (
    RpcServer,
    current_call,
    error_body,
    rpc_method,
    rpc_methods,
)
from kvpool.config import MAX_REPLICAS, MasterConfig
from kvpool.store.master.args import (
    check_force,
    int_arg,
    items_arg,
    keys_arg,
    options_arg,
    str_arg,
    tier_arg,
)
from kvpool.store.master.commits import Commits
from kvpool.store.master.movers import NodeMovers, RoomWaits
from kvpool.store.master.nudge import Nudger
from kvpool.store.master.objects import Replica, Tier
from kvpool.store.master.tracked import TrackedState
from kvpool.transfer.directory_service import DirectoryService

logger = logging.getLogger(__name__)


class MasterService:
    """The RPC methods of the master (metadata only: values never pass through here)."""

    def __init__(
        self,
        config: MasterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        rebuild_grace: float = 0.0,
        token: str | None = None,
        admin_token: str | None = None,
        commit_wait: float = 0.0,
        move_wait: float = 2.0,
    ) -> None:
        """``commit_wait`` > 0 (durable commits, for a master with a standby): a put_end
        answers once the nodes of the object hold its index delta (at most that many seconds),
        so a standby elected right after rebuilds every acknowledged put."""
        self.config = config or MasterConfig()
        self.room = RoomWaits(move_wait)  # puts told to retry while offloads free DRAM
        self.state = TrackedState(self.config, clock)
        # A master elected after a fail-over starts empty: until the nodes have mounted again
        # and reported, a miss may only mean "not reported yet", so answer "retry" instead.
        self._rebuild_until = time.monotonic() + rebuild_grace
        self._node_addresses: dict[str, str] = {}
        self._token, self._admin_token = token, admin_token  # None: from the environment
        self.directory = DirectoryService()  # the pool's segment directory (rpc://<address>)
        self.lock = threading.Lock()
        self.movers = NodeMovers(self._node_addresses, token, self.lock)
        self.state.mover, self.state.mover_async = self.movers.now, self.movers.later
        self.commits = Commits(self.state, self.lock, commit_wait)
        self.nudger = Nudger(self._node_addresses.get, token, self.commits.take,
                             self.commits.acked, min_gap=0.0 if commit_wait > 0 else 0.005)  # fmt: skip
        self.state.on_delta = self.nudger.mark
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="kvpool-master", daemon=True)
        self._ticker.start()

    def close(self) -> None:
        self._stop.set()
        self._ticker.join(timeout=5)
        self.nudger.close()
        self.movers.close()

    def _tick_loop(self) -> None:
        while not self._stop.wait(0.5):
            with self.lock:
                revoked, dead = self.state.tick()
            for key in revoked:
                logger.warning("master: put of %s timed out; revoked", key)
            for node in dead:
                logger.warning("master: node %s missed its heartbeats; dropped", node)

    # -- nodes ----------------------------------------------------------------------------------

    @rpc_method(bulk=True)
    def mount(
        self,
        node_id: str,
        segment: str,
        tier: str,
        capacity: int,
        address: str | None = None,
        objects: list | None = None,
        complete: bool = True,
        incarnation: str | None = None,
    ) -> bool:
        """A node offers a segment; ``address``: its RPC server (for tier moves); ``objects``:
        what the segment already holds, adopted in the same step, so that no allocation can
        land on it in between (a new leader rebuilding its table). ``complete`` False: more of
        its objects follow in ``report`` calls, and the segment takes no allocation until the
        one that names it. ``incarnation``: which process of the node this is (a new one
        starts clean)."""
        with self.lock:
            self.state.mount(node_id, segment, tier_arg(tier), int_arg(capacity, "capacity"),
                             ready=bool(complete), incarnation=str_arg(incarnation))  # fmt: skip
            if address:
                self._node_addresses[node_id] = address
            if objects:
                self._adopt(node_id, objects)
        return True

    @rpc_method
    def unmount(self, node_id: str, incarnation: str | None = None) -> int:
        """A node leaves: its replicas go at once (objects with no other replica are gone, a
        clean miss); the number of keys that went with it."""
        with self.lock:
            lost = self.state.unmount(node_id, str_arg(incarnation))
            self._node_addresses.pop(node_id, None)
        if lost:
            logger.info("master: node %s left with %d objects", node_id, len(lost))
        return len(lost)

    @rpc_method
    def heartbeat(self, node_id: str, epoch: str | None = None, ack: int = 0,
                  incarnation: str | None = None) -> dict:  # fmt: skip
        """``{"known", "deltas": [[op, key, size, segment, offset, checksum], ...], "epoch",
        "seq"}``: the deltas not yet acknowledged (``ack``: the last ``seq`` the node applied
        from this ``epoch``); they are resent until acknowledged, and applying one twice is
        harmless."""
        with self.lock:
            known = self.state.heartbeat(node_id, str_arg(incarnation))
            deltas, seq = self.state.take_deltas(node_id, epoch, int_arg(ack, "ack")) if known \
                else ([], 0)  # fmt: skip
            self.commits.heard(node_id, known and not deltas)
            epoch = self.state.stream_epoch(node_id) if known else None
        return {"known": known, "deltas": deltas, "epoch": epoch, "seq": seq}

    @rpc_method(bulk=True)
    def report(self, node_id: str, objects: list, complete: str | None = None) -> int:
        """A node's contents after a (re)mount: adopt what this master does not know;
        ``complete``: the segment whose report this ends (it takes allocations from now)."""
        with self.lock:
            adopted = self._adopt(node_id, objects)
            if complete is not None:
                self.state.segment_ready(node_id, complete)
            return adopted

    def _adopt(self, node_id: str, objects: list) -> int:
        """Adopt a node's objects this master does not know (called with the lock held)."""
        adopted = 0
        for key, size, segment, offset, checksum in items_arg(objects, 5, "key, size, segment, "
                                                                        "offset, checksum"):  # fmt: skip
            mounted = self.state.segments.get(segment)
            tier = mounted.tier if mounted is not None else Tier.DRAM
            replica = Replica(node_id, segment, int_arg(offset, "offset"), tier)
            meta = self.state.objects.get(key)
            if meta is not None and any(r.segment == segment for r in meta.replicas):
                continue
            try:
                self.state.adopt(node_id, key, int_arg(size, "size"), replica, checksum)
                adopted += 1
            except (KVPoolError, ValueError, KeyError) as exc:
                logger.warning("master: cannot adopt %s from %s: %s", key, node_id, exc)
        return adopted

    # -- objects --------------------------------------------------------------------------------

    def _rebuilding(self) -> bool:
        return time.monotonic() < self._rebuild_until

    def _unavailable(self, exc: KVPoolError) -> KVPoolError:
        if self._rebuilding() and isinstance(exc, NotFoundError | NoSpaceError):
            return UnavailableError(f"master is rebuilding its table after a fail-over ({exc})")
        return exc

    @rpc_method
    def put_start(self, key: str, size: int, replicas: int | None = None,
                  options: dict | None = None) -> dict:  # fmt: skip
        """Allocate the replicas of a new object: ``{key, size, replicas, put_id, ...}``;
        ``options``: ``PutOptions`` (upsert, preferred nodes, pins)."""
        owner, opts = current_call().client_id, options_arg(options)
        [out] = self.room.run(self.lock, self.state, [key], lambda _: self.state.started(
            self.state.put_start(key, int_arg(size, "size"), replicas, owner, opts)))  # fmt: skip
        if isinstance(out, KVPoolError):
            raise self._unavailable(out) if isinstance(out, NoSpaceError) else out
        return out

    @rpc_method
    def put_end(self, key: str, put_id: int, checksum: int) -> bool:
        with self.lock:
            self.state.put_end(key, put_id, checksum)
            self.commits.wait(self.commits.marks([key]))
        return True

    @rpc_method
    def put_revoke(self, key: str, put_id: int) -> bool:
        with self.lock:
            self.state.put_revoke(key, put_id)
        return True

    @rpc_method
    def get(self, key: str) -> dict:
        with self.lock:
            try:
                return self.state.wire(self.state.get(key), self.config.lease_ttl)
            except NotFoundError as exc:
                raise self._unavailable(exc) from None

    @rpc_method(bulk=True)
    def batch_get(self, keys: list[str]) -> list[dict | None]:
        out: list[dict | None] = []
        with self.lock:
            for key in keys_arg(keys):
                try:
                    out.append(self.state.wire(self.state.get(key), self.config.lease_ttl))
                except NotFoundError:
                    out.append(None)
        return out

    @rpc_method(bulk=True)
    def batch_put_start(self, items: list, replicas: int | None = None,
                        options: dict | None = None) -> list[dict]:  # fmt: skip
        """``[[key, size], ...]`` -> per item the object with its put id, or
        ``{"error": {...}}``."""
        owner, opts = current_call().client_id, options_arg(options)
        pairs = items_arg(items, 2, "key, size")
        keys_arg([p[0] for p in pairs])
        results = self.room.run(self.lock, self.state, [p[0] for p in pairs],
                                lambda i: self.state.started(self.state.put_start(
                                    pairs[i][0], int_arg(pairs[i][1], "size"), replicas, owner,
                                    opts)))  # fmt: skip
        return [{"error": error_body(r)} if isinstance(r, KVPoolError) else r for r in results]

    @rpc_method(bulk=True)
    def batch_put_end(self, items: list) -> list[bool]:
        """``[[key, put_id, checksum], ...]``; False for a key with no such put in progress."""
        out = []
        with self.lock:
            for key, put_id, checksum in items_arg(items, 3, "key, put_id, checksum"):
                try:
                    self.state.put_end(key, put_id, checksum)
                    out.append(True)
                except NotFoundError:
                    out.append(False)
            ended = [item[0] for item, ok in zip(items, out, strict=True) if ok]
            self.commits.wait(self.commits.marks(ended))
        return out

    @rpc_method(bulk=True)
    def batch_put_revoke(self, items: list) -> list[bool]:
        """``[[key, put_id], ...]``; False for a key with no such put in progress."""
        out = []
        with self.lock:
            for key, put_id in items_arg(items, 2, "key, put_id"):
                try:
                    self.state.put_revoke(key, put_id)
                    out.append(True)
                except NotFoundError:
                    out.append(False)
        return out

    @rpc_method
    def exists(self, key: str) -> bool:
        with self.lock:
            found = self.state.exists(key)
        if not found and self._rebuilding():
            raise UnavailableError("master is rebuilding its table after a fail-over")
        return found

    @rpc_method(bulk=True)
    def batch_exists(self, keys: list[str]) -> list[bool]:
        with self.lock:
            return [self.state.exists(k) for k in keys_arg(keys)]

    @rpc_method(bulk=True)
    def batch_tiers(self, keys: list[str]) -> list[str | None]:
        """Per key the tier a read would come from ("dram", "ssd") or None when missing (a
        read lease, as ``batch_exists``): what a connector weighs a load against recomputing
        with."""
        with self.lock:
            return [self.state.tier(k) for k in keys_arg(keys)]

    @rpc_method
    def remove(self, key: str, force: bool = False) -> bool:
        """Remove a COMPLETE object; refused while a reader holds its lease, unless ``force``,
        which is an admin call (readers of a forced-away object fail their checksum)."""
        check_force(force)
        with self.lock:
            self.state.remove(key, bool(force))
        return True

    @rpc_method
    def remove_matching(self, pattern: str | None = None, force: bool = False) -> int:
        """Remove every object whose key ``pattern`` matches (``re.search``; None: all), but
        the leased ones unless ``force`` (an admin call); how many went."""
        check_force(force)
        if pattern is not None and (not isinstance(pattern, str) or len(pattern) > 1024):
            raise BadRequestError("pattern must be a regular expression of at most 1024 chars")
        with self.lock:
            return self.state.remove_matching(pattern, bool(force))

    @rpc_method
    def replicas(self, key: str) -> dict | None:
        """Where ``key``'s replicas are, or None; a read lease, as ``exists`` and Mooncake's
        replica descriptors give."""
        with self.lock:
            if not self.state.exists(key):
                return None
            return self.state.wire(self.state.objects[key])

    @rpc_method
    def pin(self, key: str, pinned: bool = True, ttl: float | None = None) -> bool:
        """Soft-pin ``key`` (for ``ttl`` seconds) or unpin it."""
        if ttl is not None and not (isinstance(ttl, int | float) and 0 < ttl <= 1e9):
            raise BadRequestError("ttl must be a number of seconds > 0")
        with self.lock:
            self.state.pin(key, bool(pinned), ttl)
        return True

    @rpc_method
    def report_unreachable(self, nodes: list[str]) -> int:
        """A client could not read from these nodes: until each heartbeats again, puts of keys
        held only there are real puts and new replicas avoid them (see ``state.suspect``)."""
        if (
            not isinstance(nodes, list)
            or len(nodes) > MAX_REPLICAS
            or not all(isinstance(n, str) and 0 < len(n) <= 255 for n in nodes)
        ):
            raise BadRequestError(f"nodes must be a list of at most {MAX_REPLICAS} node ids")
        with self.lock:
            return self.state.report_unreachable(nodes)

    @rpc_method
    def stats(self) -> dict:
        with self.lock:
            used, cap = self.state.usage(Tier.DRAM)
            ssd_used, ssd_cap = self.state.usage(Tier.SSD)
            return {
                "objects": len(self.state.objects),
                "nodes": len(self.state.nodes),
                "dram_used_bytes": used,
                "dram_capacity_bytes": cap,
                "ssd_used_bytes": ssd_used,
                "ssd_capacity_bytes": ssd_cap,
                **self.state.counters,
            }

    def serve(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> RpcServer:
        """Start an RPC server for this service (the caller closes it); ``token`` defaults to
        the service's (and that to the environment's)."""
        token = self._token if token is None else token
        handler = rpc_methods(self, self.directory)
        return RpcServer(handler, host, port, token=token, admin_token=self._admin_token).start()

"""The master's side of tier moves: each is a ``copy`` RPC to the node that holds both tiers.

``later`` hands the copy to the mover thread and returns at once, and runs ``done(ok)`` under
the master's lock when the node has answered: promotions and offloads go this way, so no get
or put waits for a node, and neither does anyone queued behind it (a put that needs the DRAM
an offload frees is told to retry: ``RoomPendingError``).
``now`` copies inside the caller's critical section (the state's synchronous path, kept for
callers without a mover thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvpool.common.errors import KVPoolError, RoomPendingError
from kvpool.common.rpc_pool import RpcPool
from kvpool.store.master.objects import Replica
from kvpool.store.master.view import MovesPending

logger = logging.getLogger(__name__)
COPY_TIMEOUT = 10.0


class NodeMovers:
    def __init__(self, addresses: dict[str, str], token: str | None,
                 lock: threading.Lock) -> None:  # fmt: skip
        self._addresses = addresses  # node id -> its RPC address (the master keeps it current)
        self._token = token
        self._lock = lock
        self._clients: dict[str, RpcPool] = {}  # one connection per concurrent copy
        self._clients_lock = threading.Lock()
        # a few threads: the copies of one slow node do not hold up every other node's
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvpool-master-move")

    def now(self, src: Replica, dst: Replica, size: int) -> bool:
        address = self._addresses.get(src.node_id)
        return address is not None and src.node_id == dst.node_id and \
            self._copy(address, src, dst, size)  # fmt: skip

    def later(self, src: Replica, dst: Replica, size: int,
              done: Callable[[bool], None]) -> None:  # fmt: skip
        address = self._addresses.get(src.node_id)

        def run() -> None:
            ok = False
            try:  # a node gone (or mounted elsewhere) since: no copy at all
                ok = address is not None and src.node_id == dst.node_id and \
                    self._addresses.get(src.node_id) == address and \
                    self._copy(address, src, dst, size)  # fmt: skip
            except Exception:  # a bug or a bad address must not leave the move unreported
                logger.exception("master: moving %d bytes on %s failed", size, src.node_id)
            finally:
                with self._lock:
                    done(ok)

        try:
            self._pool.submit(run)
        except RuntimeError:  # shutting down: the promotion simply does not happen
            done(False)

    def _copy(self, address: str, src: Replica, dst: Replica, size: int) -> bool:
        with self._clients_lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = RpcPool(address, self._token,
                                                          timeout=COPY_TIMEOUT)  # fmt: skip
        try:
            return bool(client.call("copy", src.segment, src.offset, dst.segment, dst.offset,
                                    size))  # fmt: skip
        except KVPoolError as exc:
            logger.warning("master: moving %d bytes on %s failed: %s", size, src.node_id, exc)
            return False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


class RoomWaits:
    """Puts that found no DRAM while offloads free some: they get ``RoomPendingError`` (their
    clients ask again; nothing waits in the master, with or without its lock) until they have
    waited ``move_wait`` seconds; then the coldest objects are dropped for them instead."""

    def __init__(self, move_wait: float) -> None:
        self.move_wait = move_wait
        self._since: dict[str, float] = {}  # key -> when its put first found no room

    def run(self, lock: threading.Lock, state, keys: list[str], start: Callable[[int], dict],
            now: float | None = None) -> list:  # fmt: skip
        """``start(i)`` for each put under ``lock``: its result, or its error."""
        out: list = [None] * len(keys)
        now = time.monotonic() if now is None else now
        with lock:
            for i, key in enumerate(keys):
                try:
                    out[i] = start(i)
                except MovesPending as exc:
                    if now - self._since.setdefault(key, now) < self.move_wait:
                        out[i] = RoomPendingError(f"{exc}; retry in a moment")
                        continue
                    state.drop_evicts = True  # waited long enough: drop instead
                    try:
                        out[i] = start(i)
                    except KVPoolError as again:
                        out[i] = again
                    finally:
                        state.drop_evicts = False
                except KVPoolError as exc:
                    out[i] = exc
                if not isinstance(out[i], RoomPendingError):
                    self._since.pop(key, None)
            if len(self._since) > 4096:  # clients that never came back
                self._since = {k: t for k, t in self._since.items()
                               if now - t < 2 * self.move_wait}  # fmt: skip
        return out

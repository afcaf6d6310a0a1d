"""The master's side of tier moves: each is a ``copy`` RPC to the node that holds both tiers.

``now`` (offloads: an eviction needs the space at once) copies inside the caller's critical
section; ``later`` (promotions) hands the copy to the mover thread and returns at once, and
runs ``done(ok)`` under the master's lock when the node has answered, so a get never waits
for a node, and neither does anyone queued behind it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvpool.common.errors import KVPoolError
from kvpool.common.rpc import RpcClient
from kvpool.store.master.objects import Replica

logger = logging.getLogger(__name__)
COPY_TIMEOUT = 10.0


class NodeMovers:
    def __init__(self, addresses: dict[str, str], token: str | None,
                 lock: threading.Lock) -> None:  # fmt: skip
        self._addresses = addresses  # node id -> its RPC address (the master keeps it current)
        self._token = token
        self._lock = lock
        self._clients: dict[str, RpcClient] = {}
        self._clients_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvpool-master-move")

    def now(self, src: Replica, dst: Replica, size: int) -> bool:
        address = self._addresses.get(src.node_id)
        return address is not None and src.node_id == dst.node_id and \
            self._copy(address, src, dst, size)  # fmt: skip

    def later(self, src: Replica, dst: Replica, size: int,
              done: Callable[[bool], None]) -> None:  # fmt: skip
        address = self._addresses.get(src.node_id)

        def run() -> None:
            ok = address is not None and src.node_id == dst.node_id and \
                self._copy(address, src, dst, size)  # fmt: skip
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
                client = self._clients[address] = RpcClient(address, self._token,
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

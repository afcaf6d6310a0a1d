"""What the conductor sees of the simulated cluster, built as the real one builds it.

The real conductor (``conductor/cluster.py``) polls every worker's status every
``poll_interval`` seconds (its load, its cost model and the KV events since the last poll),
asks the pool's master for a request's prefix when the request arrives, and adds what it knows
itself: the prompt tokens of the prefills it sent and has not seen finish (the queue a worker
cannot have reported yet) and the requests in flight per decode worker. ``snapshot()`` hands
the policies the same ``ClusterSnapshot`` of ``WorkerView``s: stale by up to one poll for
the caches and loads, exact for the pool and for the conductor's own counts.

For speed the snapshot's objects are kept and updated in place, not copied per request: the
policies are pure functions of what they are handed and keep nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.conductor.cluster_state import (
    ClusterSnapshot,
    RequestInfo,
    WorkerLoad,
    WorkerView,
    decay_backlog,
)
from kvpool.protocol.worker import CostModel
from kvpool.sim.node import Node
from kvpool.sim.pool import PoolModel
from kvpool.sim.workload import SimRequest


class ConductorView:
    def __init__(self, nodes: list[Node], cost: CostModel, pool: PoolModel | None,
                 block_tokens: int, block_bytes: float, link_bytes_per_s: float,
                 clock: Callable[[], float] = lambda: 0.0) -> None:  # fmt: skip
        self.nodes = nodes
        self.pool = pool
        self.block_tokens = block_tokens
        self.views = [WorkerView(n.id, n.role, f"sim/{n.id}", f"sim/{n.id}", WorkerLoad(),
                                 cost, n.cache.view, step_tokens=n.budget) for n in nodes]  # fmt: skip
        self.by_id = {n.id: i for i, n in enumerate(nodes)}
        self.reported = [0] * len(nodes)  # queued prefill tokens of the last poll
        self.pending = [0] * len(nodes)  # prompt tokens of prefills sent, not finished
        self.inflight_at = [0] * len(nodes)  # requests routed to it as decode, not finished
        self.inflight = 0  # every request in flight through the conductor
        self.clock = clock  # the simulation's time
        self.backlog_at = [0.0] * len(nodes)  # when each load.backlogged was last sampled
        self.snap = ClusterSnapshot(self.views, pool_bytes_per_s=link_bytes_per_s,
                                    block_bytes=int(block_bytes), pool_up=pool is not None)  # fmt: skip
        self.polls = 0

    def poll(self) -> None:
        """Every worker's status, as of now: its cache's events and its load."""
        self.polls += 1
        for i, n in enumerate(self.nodes):
            n.cache.sync_view()
            ld = self.views[i].load
            ld.queued_prefill_tokens = self.reported[i] = n.queued_tokens
            ld.running, ld.waiting = n.batch, n.waiting
            ld.kv_usage = n.kv_used / n.kv_cap
            ld.remaining_tokens = n.remaining_tokens() if n.batch else []
            self._backlog(i)

    def request_info(self, req: SimRequest) -> RequestInfo:
        """As ``Conductor.request_info``: the chain and the pool's prefix of it (exact)."""
        pool = self.pool.prefix(req.hashes) if self.pool is not None else 0
        return RequestInfo(req.input_tokens, req.hashes, self.block_tokens, req.output_tokens,
                           pool)  # fmt: skip

    def snapshot(self) -> ClusterSnapshot:
        """The polled views plus the conductor's own counts (as ``ClusterState.snapshot``)."""
        for i, v in enumerate(self.views):
            ld = v.load
            ld.queued_prefill_tokens = max(self.reported[i], self.pending[i])
            ld.inflight = self.inflight_at[i]
            self._backlog(i)
        return self.snap

    def _backlog(self, i: int) -> None:
        """As ``ClusterState``: sampled at polls and routings."""
        ld, now = self.views[i].load, self.clock()
        queue = max(self.reported[i], self.pending[i])
        ld.backlogged = decay_backlog(ld.backlogged, queue > 0, now - self.backlog_at[i])
        self.backlog_at[i] = now

    def view(self, node_id: str) -> WorkerView:
        return self.views[self.by_id[node_id]]

    # -- the conductor's own bookkeeping ----------------------------------------------------

    def sent_prefill(self, node_id: str, tokens: int) -> None:
        self.pending[self.by_id[node_id]] += tokens

    def prefill_returned(self, node_id: str, tokens: int) -> None:
        self.pending[self.by_id[node_id]] -= tokens

    def took_flight(self, decode_id: str) -> None:
        self.inflight += 1
        self.inflight_at[self.by_id[decode_id]] += 1

    def released(self, decode_id: str) -> None:
        self.inflight -= 1
        i = self.by_id[decode_id]
        self.inflight_at[i] = max(0, self.inflight_at[i] - 1)

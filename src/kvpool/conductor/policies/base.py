"""The policy interface and the two predictions every policy shares (TTFT and TBT)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

from kvpool.conductor.cluster_state import (
    ClusterSnapshot,
    Placement,
    RequestInfo,
    WorkerView,
)


def by_id(workers: list[WorkerView]) -> list[WorkerView]:
    """Workers in id order, numbers by value ("prefill-2" before "prefill-10"): the order ties
    are broken in."""
    return sorted(workers, key=lambda w: [int(p) if p.isdigit() else p
                                          for p in re.split(r"(\d+)", w.id)])  # fmt: skip


def predicted_ttft(snap: ClusterSnapshot, w: WorkerView, req: RequestInfo) -> Placement:
    """Queue time + prefill of the tokens it would compute + loading what the pool has beyond
    its own cache (the paper's TTFT estimate). A worker that also decodes runs the prefill in
    steps shared with its running decodes: their step time is added once (the first chunk's)."""
    hashes = list(req.block_hashes)
    local = w.local_prefix_blocks(hashes)
    pool = req.pool_prefix_blocks if snap.pool_up else 0
    prefix = max(local, pool)
    loaded = max(0, prefix - local)
    transfer_s = loaded * snap.block_bytes / snap.pool_bytes_per_s if snap.pool_bytes_per_s else 0
    uncached = max(1, req.num_prompt_tokens - prefix * req.block_size)
    ttft = w.queue_s() + w.cost.prefill_s(uncached) + transfer_s
    if w.decodes and w.load.running:
        ttft += w.cost.decode_step_s(w.load.running)
    return Placement(w.id, ttft, local, loaded)


def predicted_tbt(w: WorkerView, arrival_s: float) -> float:
    """Time between tokens on ``w`` once a request arriving in ``arrival_s`` joins it: the
    running requests that will still run then, those already routed to it, and this one."""
    step = w.cost.decode_step_s(max(w.load.running, 1))
    still = sum(1 for left in w.load.remaining_tokens if left * step > arrival_s)
    unknown = max(0, w.load.running - len(w.load.remaining_tokens))  # not itemised
    return w.cost.decode_step_s(still + unknown + w.load.inflight + 1)


class Policy(ABC):
    """Chooses the prefill worker and the decode worker of a request."""

    name = "policy"

    @abstractmethod
    def choose_prefill(self, snap: ClusterSnapshot, req: RequestInfo) -> Placement | None:
        """The prefill (or colocated) worker; None if none is alive."""

    def choose_decode(
        self, snap: ClusterSnapshot, req: RequestInfo, ttft_s: float
    ) -> Placement | None:
        """Default: the decode worker with the lowest predicted TBT when the request gets there."""
        best = None
        for w in snap.alive(lambda w: w.role == "decode"):
            p = Placement(w.id, predicted_tbt(w, ttft_s))
            if best is None or p.predicted_s < best.predicted_s:
                best = p
        return best

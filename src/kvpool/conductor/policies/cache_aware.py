"""The paper's Algorithm 1: KVCache-centric prefill selection with hot-spot balancing.

For every prefill worker, estimate TTFT as queue time + prefill of the tokens it would still
compute + the transfer of the blocks it would load from the pool (the pool holds every block
any worker published, so a worker's usable prefix is the longer of its own cache and the
pool's chain). Choose the minimum, with one exception that keeps hot prefixes local: when the
worker holding the longest local prefix is within ``balancing_threshold`` of the best estimate,
it gets the request (no transfer, no duplicate copy). Beyond that margin the holder is a hot
spot, and the request goes to another worker that pulls the prefix from the pool: the prefix is
replicated where the load is, not where it was first computed.
"""

from __future__ import annotations

from kvpool.conductor.cluster_state import ClusterSnapshot, Placement, RequestInfo
from kvpool.conductor.policies.base import Policy, by_id, predicted_ttft


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(self, balancing_threshold: float = 0.25) -> None:
        if balancing_threshold < 0:
            raise ValueError("balancing_threshold must be >= 0")
        self.balancing_threshold = balancing_threshold

    def choose_prefill(self, snap: ClusterSnapshot, req: RequestInfo) -> Placement | None:
        ws = by_id(snap.alive(lambda w: w.prefills))
        if not ws:
            return None
        estimates = [predicted_ttft(snap, w, req) for w in ws]
        best = min(estimates, key=lambda p: p.predicted_s)
        best_local = max(p.local_blocks for p in estimates)
        if best_local == 0 or best.local_blocks == best_local:
            return best
        holder = min(
            (p for p in estimates if p.local_blocks == best_local), key=lambda p: p.predicted_s
        )
        if holder.predicted_s <= best.predicted_s * (1 + self.balancing_threshold):
            return holder
        return best

"""The paper's local cache-aware scheduling: cache-aware, but each prefill worker counts
only the prefix in its own cache.

For every prefill worker, TTFT is estimated as queue time + prefill of the tokens beyond its
*local* prefix (the pool is left out of the estimate: no worker is expected to load another's
blocks); the minimum wins, so the holder of the longest local prefix gets the request unless
its queue costs more than the prefix saves. Compared with ``cache_aware`` (the paper's global
KVCache-centric scheduling), nothing is planned to come from the pool and hot prefixes are
never replicated on purpose.
"""

from __future__ import annotations

from dataclasses import replace

from kvpool.conductor.cluster_state import ClusterSnapshot, Placement, RequestInfo
from kvpool.conductor.policies.base import Policy, by_id, predicted_ttft


class LocalCacheAwarePolicy(Policy):
    name = "local"

    def choose_prefill(self, snap: ClusterSnapshot, req: RequestInfo) -> Placement | None:
        ws = by_id(snap.alive(lambda w: w.prefills))
        if not ws:
            return None
        local_only = replace(req, pool_prefix_blocks=0)
        return min((predicted_ttft(snap, w, local_only) for w in ws),
                   key=lambda p: p.predicted_s)  # fmt: skip

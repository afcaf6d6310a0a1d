"""Routing policies: pure functions of a cluster snapshot (plus a seed or a counter).

``get_policy(name)`` builds one of: ``random``, ``round_robin``, ``least_load``, ``local``
(cache-aware on each worker's own cache), ``cache_aware`` (the paper's global Algorithm 1).
"""

from __future__ import annotations

from kvpool.conductor.policies.base import Policy, predicted_tbt, predicted_ttft
from kvpool.conductor.policies.cache_aware import CacheAwarePolicy
from kvpool.conductor.policies.local import LocalCacheAwarePolicy
from kvpool.conductor.policies.simple import LeastLoadPolicy, RandomPolicy, RoundRobinPolicy

POLICIES: dict[str, type[Policy]] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "local": LocalCacheAwarePolicy,
    "cache_aware": CacheAwarePolicy,
}


def get_policy(name: str, **kwargs) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}"
        ) from None
    return cls(**kwargs)


__all__ = ["POLICIES", "Policy", "get_policy", "predicted_tbt", "predicted_ttft"]

"""What to simulate: a cluster shape with a routing policy (a *system*), and the settings
every system of a run shares."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.conductor.policies import POLICIES, Policy, get_policy
from kvpool.sim.profile import Profile

# the paper's names for the policies --policy takes (and the conductor's own names)
POLICY_NAMES = ("cache_aware", "local", "least_load", "random", "round_robin")


@dataclass(slots=True)
class SystemSpec:
    """``prefill`` + ``decode`` nodes (disaggregated), or ``colocated`` nodes doing both
    (vLLM-like: each computes its prompts and decodes them; ``chunked``: with chunked
    prefill). ``policy``: a name of ``conductor.policies`` or a ``Policy`` object.
    ``pool``: whether the shared pool exists (every worker reads it and publishes to it)."""

    name: str
    policy: str | Policy
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    chunked: bool = True
    pool: bool = True

    def __post_init__(self) -> None:
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("node counts must be >= 0")
        if self.colocated:
            if self.prefill or self.decode:
                raise ValueError("a system is either colocated or prefill + decode nodes")
        elif self.prefill < 1 or self.decode < 1:
            raise ValueError("a disaggregated system needs >= 1 prefill and >= 1 decode node")
        if isinstance(self.policy, str) and self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}")

    @property
    def shape(self) -> str:
        if self.colocated:
            return f"{self.colocated}x colocated" + (" (chunked prefill)" if self.chunked else "")
        return f"{self.prefill}P+{self.decode}D"


@dataclass(slots=True)
class SimConfig:
    """Settings shared by every system of a run. ``None`` SLOs are not enforced; with
    ``admission`` the router rejects early what its predictions say would break them."""

    profile: Profile
    block_tokens: int
    slo_ttft: float | None = None
    slo_tbt: float | None = None
    admission: bool = True
    max_inflight: int = 1_000_000
    decode_prefill_tokens: int = 64  # the conductor's default (router.py)
    decode_prefill_gain: float = 2.0  # the conductor's default
    balancing_threshold: float = 0.25
    poll_interval: float = 0.2  # the conductor's default (cluster.py); 0: always fresh
    seed: int = 0
    local_cache_blocks: int | None = None  # overrides the profile's
    pool_blocks_per_node: int | None = None
    pool_nodes: int | None = None
    samples: int = 200  # timeline points (queues, batches, pool) over the run

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        for name in ("slo_ttft", "slo_tbt"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0 (or None)")
        if self.max_inflight < 1 or self.decode_prefill_tokens < 0 or self.poll_interval < 0:
            raise ValueError("max_inflight >= 1, decode_prefill_tokens and poll_interval >= 0")
        if self.decode_prefill_gain != 0 and not self.decode_prefill_gain >= 1:
            raise ValueError("decode_prefill_gain must be 0 (off) or >= 1")
        for name in ("local_cache_blocks", "pool_blocks_per_node", "pool_nodes"):
            v = getattr(self, name)
            if v is not None and v < (0 if name == "local_cache_blocks" else 1):
                raise ValueError(f"{name} out of range: {v}")
        if self.samples < 2:
            raise ValueError("samples must be >= 2")

    def make_policy(self, system: SystemSpec) -> Policy:
        if not isinstance(system.policy, str):
            return system.policy
        kwargs: dict = {}
        if system.policy == "cache_aware":
            kwargs["balancing_threshold"] = self.balancing_threshold
        elif system.policy == "random":
            kwargs["seed"] = self.seed
        return get_policy(system.policy, **kwargs)


def default_pool(policy: str, colocated: bool) -> bool:
    """``--pool auto``: the pool for every disaggregated policy but ``local`` (the paper's
    local cache-aware scheduling uses each node's own cache only); none for colocated nodes
    (the vLLM-like baseline has local prefix caches only)."""
    return not colocated and policy != "local"


def parse_policies(text: str, pool: str, colocated: bool) -> list[tuple[str, bool]]:
    """``cache_aware,local,least_load:nopool`` -> [(policy, pool?)]; ``:pool`` / ``:nopool``
    override ``pool`` (auto | on | off) for one policy."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, flag = item.partition(":")
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} in --policy; choose from "
                             f"{', '.join(sorted(POLICIES))}")  # fmt: skip
        if flag not in ("", "pool", "nopool"):
            raise ValueError(f"{item!r}: a policy's suffix is :pool or :nopool")
        if flag:
            use = flag == "pool"
        elif pool == "auto":
            use = default_pool(name, colocated)
        else:
            use = pool == "on"
        out.append((name, use))
    if not out:
        raise ValueError("--policy names no policy")
    return out

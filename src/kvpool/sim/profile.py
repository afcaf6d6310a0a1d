"""Simulation profiles: the model, one node's hardware and serving limits, the network and
the pool, as one JSON file (``profiles/NAME.json``, or any path) with its sources.

A profile is what the simulator's cost model (``cost.py``) reads. ``a800-llama`` is built
from published figures (its ``sources`` and ``assumptions`` say which); ``kvpool sim
calibrate`` writes one measured on this machine (``calibrate.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A profile that cannot be used (missing file, bad JSON, a field out of range)."""


def _positive(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0 \
                or not math.isfinite(v):  # fmt: skip
            raise ValueError(f"{name} must be a number > 0, got {v!r}")


def _non_negative(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int | float) or isinstance(v, bool) or v < 0 or not math.isfinite(v):
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """A Llama-family decoder's dimensions: enough for FLOPs and bytes."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype_bytes: float = 2.0  # bytes per KV element
    weight_bytes: float | None = None  # bytes read per step for the weights (None: from dims)
    weight_dtype_bytes: float = 2.0  # used when weight_bytes is None

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "hidden_size", "intermediate_size", "num_heads",
                  "num_kv_heads", "head_dim", "vocab_size", "kv_dtype_bytes",
                  "weight_dtype_bytes")  # fmt: skip
        if self.weight_bytes is not None:
            _positive(self, "weight_bytes")

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matrices (q, k, v, o projections and the gated MLP)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        return attn + 3 * self.hidden_size * self.intermediate_size

    @property
    def linear_flops_per_token(self) -> float:
        """Matrix FLOPs of one token through every layer (no LM head, no attention)."""
        return 2.0 * self.num_layers * self.layer_params

    @property
    def lm_head_flops(self) -> float:
        """FLOPs of the logits of one position."""
        return 2.0 * self.hidden_size * self.vocab_size

    def attention_flops(self, new: int | float, context: int | float) -> float:
        """Scores and weighted sum of ``new`` tokens after ``context`` earlier ones (causal)."""
        pairs = new * context + new * (new + 1) / 2
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * pairs

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def step_weight_bytes(self) -> float:
        """Weight bytes one forward pass reads (every layer and the LM head)."""
        if self.weight_bytes is not None:
            return self.weight_bytes
        params = self.num_layers * self.layer_params + self.hidden_size * self.vocab_size
        return params * self.weight_dtype_bytes


@dataclass(slots=True, frozen=True)
class NodeSpec:
    """One serving node (one engine instance): compute, memory and its serving limits."""

    flops_per_s: float  # peak dense FLOPs of the node (all its accelerators)
    mfu: float  # share of the peak the linear layers reach
    mem_bytes_per_s: float  # peak memory bandwidth of the node
    mem_efficiency: float  # share of it a decode step reaches
    attn_mfu: float | None = None  # share of the peak attention reaches (None: mfu)
    overlap: bool = True  # step time = max(compute, memory) (True) or their sum (False)
    step_base_s: float = 0.0  # fixed cost of a step (launches, collectives, the scheduler)
    decode_seq_s: float = 0.0  # cost of each decoding sequence in a step (sampling, bookkeeping)
    max_batch: int = 128  # running sequences per node
    max_batched_tokens: int = 8192  # tokens per step
    # tokens per step on prefill nodes (kvpool serve's --prefill-chunk; None: max_batched_tokens)
    prefill_chunk_tokens: int | None = None
    # tokens per step on decode nodes (kvpool serve's --decode-chunk; None: max_batched_tokens)
    decode_chunk_tokens: int | None = None
    colocated_chunk_tokens: int = 2048  # the token budget of a chunked colocated step
    kv_capacity_tokens: int = 1_000_000  # KV a decode node can hold for running requests
    local_cache_blocks: int = 1000  # the node's own prefix cache (LRU), in blocks
    threads: int = 1  # CPU threads a node uses (with host_cores: nodes share one host)
    host_cores: int | None = None  # every node on one host with this many cores (validation)
    # the decode node computes the prompt's last partial block (at least its last token)
    # itself, and only full blocks are transferred: kvpool's decode worker. False: the whole
    # prompt's KV is transferred (Mooncake's decode instances)
    decode_tail: bool = False

    def __post_init__(self) -> None:
        _positive(self, "flops_per_s", "mfu", "mem_bytes_per_s", "mem_efficiency",
                  "max_batch", "max_batched_tokens", "colocated_chunk_tokens",
                  "kv_capacity_tokens", "threads")  # fmt: skip
        _non_negative(self, "step_base_s", "decode_seq_s", "local_cache_blocks")
        if self.attn_mfu is not None:
            _positive(self, "attn_mfu")
        for name in ("mfu", "mem_efficiency", "attn_mfu"):
            v = getattr(self, name)
            if v is not None and v > 1:
                raise ValueError(f"{name} must be <= 1 (a share of the peak), got {v}")
        if self.host_cores is not None:
            _positive(self, "host_cores")
        for name in ("prefill_chunk_tokens", "decode_chunk_tokens"):
            if getattr(self, name) is not None:
                _positive(self, name)


@dataclass(slots=True, frozen=True)
class NetworkSpec:
    """Each node's network link: bytes per second in, and a fixed cost per transfer."""

    bytes_per_s: float
    request_overhead_s: float = 0.001

    def __post_init__(self) -> None:
        _positive(self, "bytes_per_s")
        _non_negative(self, "request_overhead_s")


@dataclass(slots=True, frozen=True)
class PoolSpec:
    """The shared KV pool: capacity per pool node, and how many (None: one per node)."""

    blocks_per_node: int
    nodes: int | None = None

    def __post_init__(self) -> None:
        _positive(self, "blocks_per_node")
        if self.nodes is not None:
            _positive(self, "nodes")


@dataclass(slots=True, frozen=True)
class Profile:
    name: str
    model: ModelSpec
    node: NodeSpec
    network: NetworkSpec
    pool: PoolSpec
    block_tokens: int = 512  # tokens per KV block (and per trace block, unless scaled)
    description: str = ""
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()
    measured: dict = field(default_factory=dict, hash=False)  # calibration's raw figures

    def __post_init__(self) -> None:
        _positive(self, "block_tokens")

    @property
    def block_bytes(self) -> float:
        return self.block_tokens * self.model.kv_bytes_per_token

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sources"], d["assumptions"] = list(self.sources), list(self.assumptions)
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def _section(cls, d: object, where: str):
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected an object")
    known = {f.name for f in fields(cls)}
    extra = sorted(set(d) - known)
    if extra:
        raise ProfileError(f"{where}: unknown field(s) {extra}; known: {sorted(known)}")
    try:
        return cls(**d)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{where}: {exc}") from None


def profile_from_dict(d: object, where: str = "profile") -> Profile:
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected a JSON object")
    top = dict(d)
    try:
        parts = {k: _section(cls, top.pop(k), f"{where}: {k}")
                 for k, cls in (("model", ModelSpec), ("node", NodeSpec),
                                ("network", NetworkSpec), ("pool", PoolSpec))}  # fmt: skip
    except KeyError as exc:
        raise ProfileError(f"{where}: missing section {exc}") from None
    for k in ("sources", "assumptions"):
        if k in top:
            if not isinstance(top[k], list) or not all(isinstance(s, str) for s in top[k]):
                raise ProfileError(f"{where}: {k} must be a list of strings")
            top[k] = tuple(top[k])
    return _section(Profile, {**top, **parts}, where)


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A built-in profile by name (``a800-llama``, ``local-smollm2``) or a JSON file."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILE_DIR / f"{name_or_path}.json"
        if not p.exists():
            raise ProfileError(f"no profile named {name_or_path!r}; built in: "
                               f"{', '.join(builtin_profiles())} (or give a .json path)")  # fmt: skip
    try:
        doc = json.loads(p.read_text())
    except OSError as exc:
        raise ProfileError(f"cannot read profile {p}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{p}: invalid JSON: {exc}") from None
    return profile_from_dict(doc, str(p))

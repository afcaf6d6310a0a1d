"""Configuration: one dataclass per subsystem, composed (DESIGN.md §4)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "KIB": 2**10,
    "KI": 2**10,
    "M": 10**6,
    "MB": 10**6,
    "MIB": 2**20,
    "MI": 2**20,
    "G": 10**9,
    "GB": 10**9,
    "GIB": 2**30,
    "GI": 2**30,
    "T": 10**12,
    "TB": 10**12,
    "TIB": 2**40,
    "TI": 2**40,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"1GiB"``, ``"2GB"``."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m or (m.group(2) or "").upper() not in _UNITS:
        raise ValueError(f"cannot parse size {value!r} (examples: 1048576, 512MiB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


DTYPES = ("float32", "bfloat16")


@dataclass(slots=True)
class EngineConfig:
    """The inference engine's knobs (names follow vLLM's engine arguments)."""

    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_memory_bytes: int | str = "1GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; default: all cores
    served_model_name: str | None = None
    use_kernels: bool = True  # compiled paged-attention kernel (falls back if unavailable)
    kv_load_timeout_s: float = 10.0  # a background prefix load slower than this is recomputed

    def __post_init__(self) -> None:
        if self.dtype in ("bf16", "auto"):
            self.dtype = "bfloat16" if self.dtype == "bf16" else "float32"
        if self.dtype in ("fp32", "float"):
            self.dtype = "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError("block_size must be in [1, 1024]")
        self.kv_cache_memory_bytes = parse_size(self.kv_cache_memory_bytes)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")


TRANSPORT_CHOICES = ("auto", "shm", "tcp")
MAX_FRAME_BYTES = 64 << 20  # a transfer frame never carries more; larger requests are sliced


@dataclass(slots=True)
class TransferConfig:
    """The transfer engine: where it listens, how it finds segments, how it moves bytes."""

    host: str = "127.0.0.1"  # where the TCP server binds
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # the address peers dial; default: host
    # memory | rpc://HOST:PORT | http://HOST:PORT | etcd://HOST:PORT[,HOST:PORT]; None: the
    # store master's when a store client or node makes the engine, else memory
    directory: str | None = None
    transport: str = "auto"  # auto: shared memory for same-host peers, TCP otherwise
    auth_token: str | None = None  # default: the environment's (auth.cluster_token); "" none
    num_streams: int = 2  # TCP connections per peer that large requests are striped over
    slice_bytes: int | str = "1MiB"  # large requests move as frames of at most this size
    max_inflight_bytes: int | str = "256MiB"  # per peer; submit waits (or raises) above it
    shm_inline_bytes: int | str = "64MiB"  # smaller shm batches are copied inside submit()
    tcp_inline_bytes: int | str = "1MiB"  # smaller TCP trains are sent by the submitting thread
    request_timeout: float = 30.0  # seconds per request, from submit
    connect_timeout: float = 5.0
    segment_ttl: float = 10.0  # etcd lease of published descriptors (renewed while alive)

    def __post_init__(self) -> None:
        from kvpool.common.auth import cluster_token
        from kvpool.common.net import is_loopback

        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {TRANSPORT_CHOICES}")
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        self.slice_bytes = parse_size(self.slice_bytes)
        self.max_inflight_bytes = parse_size(self.max_inflight_bytes)
        self.shm_inline_bytes = parse_size(self.shm_inline_bytes)
        self.tcp_inline_bytes = parse_size(self.tcp_inline_bytes)
        if not 4096 <= self.slice_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"slice_bytes must be in [4096, {MAX_FRAME_BYTES}]")
        if self.max_inflight_bytes < 1:
            raise ValueError("max_inflight_bytes must be >= 1")
        if not 1 <= self.num_streams <= 64:
            raise ValueError("num_streams must be in [1, 64]")
        if self.request_timeout <= 0 or self.connect_timeout <= 0 or self.segment_ttl < 2:
            raise ValueError("timeouts must be > 0 and segment_ttl >= 2 s")
        if self.auth_token is None:
            self.auth_token = cluster_token()
        if not is_loopback(self.host) and not self.auth_token:
            raise ValueError(
                f"binding {self.host} (not loopback) requires an auth token: set KVPOOL_AUTH_TOKEN"
            )


MAX_REPLICAS = 16


@dataclass(slots=True)
class MasterConfig:
    """The store master's policies (DESIGN.md §3 store semantics)."""

    replicas: int = 1  # default copies per object, each on a different node
    high_watermark: float = 0.9  # eviction starts above this fraction of a tier's capacity
    low_watermark: float = 0.8  # ... and frees down to this
    lease_ttl: float = 10.0  # seconds a get protects an object from eviction and removal
    put_timeout: float = 10.0  # a put not ended within this (plus size / put_min_rate) is
    put_min_rate: int | str = "32MiB"  # ... revoked and its space reclaimed; bytes per second
    max_pending_bytes: int | str = "1GiB"  # per client: bytes of puts started and not ended
    node_ttl: float = 10.0  # a node silent for this long is dropped with its replicas
    node_suspect_after: float | None = None  # silent this long: a put may replace its objects
    # (default: 3 missed heartbeats, at most node_ttl)
    half_life: float = 60.0  # access-frequency decay (eviction heat)
    cooldown: float = 5.0  # a just-moved object is not moved again before this
    max_object_bytes: int | str = "256MiB"

    def __post_init__(self) -> None:
        self.max_object_bytes = parse_size(self.max_object_bytes)
        self.put_min_rate = parse_size(self.put_min_rate)
        self.max_pending_bytes = parse_size(self.max_pending_bytes)
        if self.put_min_rate < 1 or self.max_pending_bytes < 1:
            raise ValueError("put_min_rate and max_pending_bytes must be >= 1")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be in [1, {MAX_REPLICAS}]")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark < high_watermark <= 1")
        if self.node_suspect_after is None:
            self.node_suspect_after = min(3.0, self.node_ttl)
        for name in ("lease_ttl", "put_timeout", "node_ttl", "half_life", "node_suspect_after"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.node_suspect_after > self.node_ttl:
            raise ValueError("node_suspect_after must be <= node_ttl")
        if self.cooldown < 0 or self.max_object_bytes < 1:
            raise ValueError("cooldown must be >= 0 and max_object_bytes >= 1")

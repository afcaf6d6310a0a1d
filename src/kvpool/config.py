"""Configuration: one dataclass per subsystem, composed (DESIGN.md §4).

Subsystems: ``EngineConfig``, ``TransferConfig``, ``MasterConfig``, ``HttpLimits``. Processes:
``WorkerConfig`` (a ``kvpool worker``), ``NodeConfig`` (a ``kvpool store node``),
``ConductorConfig`` (the front door) and ``ClusterConfig`` (``kvpool serve``'s embedded
cluster, which hands each child its config). ``to_wire`` / ``from_wire`` turn any of them into
plain JSON-able data and back, checking every key (the launcher sends its children configs
that way, not re-serialized flags).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field

from kvpool.protocol.cluster import ROLES

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
WEIGHT_FORMATS = ("auto", "float32", "int8", "q4")
KV_CACHE_DTYPES = ("auto", "int8")


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
    # linear layers' weights: float32 (dequantized: exactly the file's values), q4 (the GGUF's
    # own 4-bit blocks), int8 (8-bit blocks), auto (model/weight_formats.py decides)
    weights: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; int8: per-token, per-head scales

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
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
DEFAULT_SPIN_US = 500  # TransferConfig.spin_us: the store get/put latency knob (0: never spin)


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
    # a synchronous caller (a store get or put) polls for its reply this long before it
    # sleeps on the socket (common.net.spin_until_readable); 0 in processes that compute
    spin_us: int = DEFAULT_SPIN_US

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
        if not 0 <= self.spin_us <= 100_000:
            raise ValueError("spin_us must be in [0, 100000]")
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


@dataclass(slots=True)
class HttpLimits:
    """Limits before work of kvpool's HTTP servers (``serving/http_limits.py`` applies them)."""

    max_body_bytes: int | str = "4MiB"
    max_connections: int = 512  # connections and requests at once (uvicorn's limit_concurrency)
    header_timeout: float = 10.0  # seconds to send the request headers
    body_timeout: float = 30.0  # seconds to send the body

    def __post_init__(self) -> None:
        self.max_body_bytes = parse_size(self.max_body_bytes)
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1 KiB")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if self.header_timeout <= 0 or self.body_timeout <= 0:
            raise ValueError("header_timeout and body_timeout must be > 0")


KV_LOADS = ("async", "sync")
FETCH_POLICIES = ("auto", "always")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _check_log_level(level: str) -> None:
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {LOG_LEVELS}")


@dataclass(slots=True)
class WorkerConfig:
    """One engine process of the cluster (``kvpool worker``)."""

    role: str = "both"
    worker_id: str | None = None  # default: <role>-<pid>
    host: str = "127.0.0.1"
    port: int = 0  # HTTP (0: a free one)
    rpc_port: int = 0  # control RPC (0: a free one)
    store: str | None = None  # the pool's master HOST:PORT or etcd://... (None: no pool)
    transport: str = "auto"
    directory: str | None = None  # segment directory (default: etcd's if etcd, else the master's)
    etcd: str | None = None  # endpoints to register in
    pool_timeout: float = 3.0  # seconds a load or save may wait for the pool
    kv_load: str = "async"  # async: prefix loads run while other requests step
    fetch_policy: str = "auto"  # auto: load a prefix only when faster than recomputing it
    # the host's core ledger and this worker's slot in it (engine/core_share.py; kvpool serve
    # creates one): steps take the cores of idle workers of the same host
    core_ledger: str | None = None
    core_slot: int = 0
    core_slots: int = 0  # > 0: create the ledger with this many slots if it does not exist
    log_level: str = "info"
    engine: EngineConfig = field(default_factory=EngineConfig)
    http: HttpLimits = field(default_factory=HttpLimits)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {TRANSPORT_CHOICES}")
        if self.kv_load not in KV_LOADS or self.fetch_policy not in FETCH_POLICIES:
            raise ValueError(f"kv_load must be one of {KV_LOADS}, fetch_policy one of "
                             f"{FETCH_POLICIES}")  # fmt: skip
        if not self.pool_timeout > 0:
            raise ValueError("pool_timeout must be > 0")
        if self.core_slot < 0 or self.core_slots < 0:
            raise ValueError("core_slot and core_slots must be >= 0")
        if self.core_slots and self.core_slot >= self.core_slots:
            raise ValueError("core_slot must be below core_slots")
        for port in (self.port, self.rpc_port):
            if not 0 <= port <= 65535:
                raise ValueError("ports must be in [0, 65535]")
        _check_log_level(self.log_level)


@dataclass(slots=True)
class NodeConfig:
    """One storage node of the pool (``kvpool store node``)."""

    master: str = ""  # HOST:PORT or etcd://...
    memory: int | str = "512MiB"  # its DRAM tier
    ssd_path: str | None = None  # directory of its SSD tier (None: no SSD tier)
    ssd_size: int | str = 0
    node_id: str | None = None  # default: <hostname>-<pid>
    host: str = "127.0.0.1"  # where its transfer server binds
    directory: str | None = None  # default: the master's
    metrics_port: int | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        self.memory = parse_size(self.memory)
        self.ssd_size = parse_size(self.ssd_size)
        if self.memory < 1:
            raise ValueError("memory must be > 0")
        _check_log_level(self.log_level)


@dataclass(slots=True)
class ConductorConfig:
    """The front door and global scheduler (``kvpool conductor``, and inside ``kvpool serve``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: list[str] = field(default_factory=list)  # control RPC addresses (or etcd)
    etcd: str | None = None  # where workers register
    store: str | None = None  # the pool's master (its hit counts feed the dashboard)
    model: str | None = None  # whose tokenizer to load (None: the default model)
    served_model_name: str = "SmolLM2-135M-Instruct"
    policy: str = "cache_aware"
    balancing_threshold: float = 0.25
    slo_ttft: float = 30.0  # seconds (0: off)
    slo_tbt: float = 2.0  # seconds (0: off)
    decode_prefill_tokens: int = 64  # at most this many left: no prefill hand-off
    decode_prefill_gain: float = 2.0  # a decode worker takes a whole prompt when TTFT / this
    max_inflight: int = 64  # requests in flight before 429
    log_level: str = "info"
    http: HttpLimits = field(default_factory=HttpLimits)
    vllm: list[str] = field(default_factory=list)  # vLLM servers: HOST:PORT[,role=..][,events=..]
    vllm_model: str | None = None  # the Hugging Face folder they serve (default: model)
    vllm_dtype: str = "float32"  # their --dtype (part of the pool namespace)
    prefill_wait: float = 5.0  # seconds a vLLM prefill's KV may take to reach the pool

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        if self.prefill_wait < 0:
            raise ValueError("prefill_wait must be >= 0")
        if self.slo_ttft < 0 or self.slo_tbt < 0 or self.balancing_threshold < 0:
            raise ValueError("slo_ttft, slo_tbt and balancing_threshold must be >= 0")
        if self.decode_prefill_tokens < 0 or self.max_inflight < 1:
            raise ValueError("decode_prefill_tokens must be >= 0 and max_inflight >= 1")
        if self.decode_prefill_gain != 0 and not self.decode_prefill_gain >= 1:
            raise ValueError("decode_prefill_gain must be 0 (off) or >= 1")
        _check_log_level(self.log_level)


@dataclass(slots=True)
class ClusterConfig:
    """``kvpool serve``'s embedded cluster: the pool (a master and one node), the workers and
    the conductor in front of them."""

    prefill: int = 1
    decode: int = 1
    colocated: int = 0  # N workers doing both with local prefix caching only (no pool)
    store_memory: int | str = "1GiB"  # the node's DRAM
    prefill_chunk: int = 128  # prefill workers' tokens per step (0: max_num_batched_tokens)
    decode_chunk: int = 256  # decode workers' tokens per step (0: max_num_batched_tokens)
    decode_threads: int | None = None  # torch threads of each decode worker (None: its share)
    # workers step on the cores of idle ones (engine/core_share.py); off when threads are given
    share_cores: bool = True
    engine: EngineConfig = field(default_factory=EngineConfig)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)

    def __post_init__(self) -> None:
        self.store_memory = parse_size(self.store_memory)
        if min(self.colocated, self.prefill, self.decode, self.prefill_chunk,
               self.decode_chunk) < 0:  # fmt: skip
            raise ValueError("worker counts, prefill_chunk and decode_chunk must be >= 0")
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ValueError("decode_threads must be >= 1")
        if not self.colocated and self.prefill + self.decode < 1:
            raise ValueError("start at least one worker")


def to_wire(config: object) -> dict:
    """A config as plain data (JSON or YAML)."""
    return dataclasses.asdict(config)  # type: ignore[call-overload]


C = typing.TypeVar("C")


def from_wire(cls: type[C], data: object, where: str = "config") -> C:
    """A config from plain data; ``ValueError`` naming any unknown key or bad value."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(map(str, data)) - names)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown} for {cls.__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            value = from_wire(hint, value, f"{where}.{key}")  # type: ignore[arg-type]
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None

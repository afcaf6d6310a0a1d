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

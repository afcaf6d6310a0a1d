"""int8 KV blocks (``kv_cache_dtype="int8"``): each token's key or value of one head is stored
as ``head_dim`` signed bytes followed by its float32 scale (``max|x| / 127``), so a row is
``head_dim + 4`` bytes instead of ``4 * head_dim``: a block moves and rests in the pool at
0.27 of float32's bytes (68 of 256 for head_dim 64).

Scales are per token and head rather than per block: a block fills one token at a time during
decode, and a per-block scale would mean re-quantizing its earlier tokens whenever a larger
value arrived. The layout stays the engine's (DESIGN.md §3): block-major, one contiguous byte
range per block, so the connectors, the pool and direct reads move int8 blocks unchanged; the
KV format is in the namespace, so float and int8 blocks never share keys.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The last dimension of the cache: ``head_dim``, plus the scale's bytes for int8."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` floats as int8 rows ``[..., D + 4]`` (values, then the float32 scale)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale))).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows ``[..., D + 4]`` back to ``[..., D]`` in ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)

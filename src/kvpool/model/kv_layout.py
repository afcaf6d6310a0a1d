"""The engine's KV tensor (DESIGN.md §3): block-major, one contiguous byte range per block.

``[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]`` in the model's
dtype. One block moves as one memcpy and is one pool object.
"""

from __future__ import annotations

import torch

from kvpool.model.config import ModelConfig


def kv_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)


def allocate_kv_cache(model, num_blocks: int, block_size: int) -> torch.Tensor:
    """The block-major KV tensor of ``model`` (a ``LlamaModel``)."""
    return torch.zeros(kv_shape(model.cfg, num_blocks, block_size), dtype=model.dtype)


def kv_bytes_per_block(model, block_size: int) -> int:
    """Bytes of one block of every layer (keys and values)."""
    c = model.cfg
    elem = torch.empty((), dtype=model.dtype).element_size()
    return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * elem

"""The engine's KV tensor (DESIGN.md §3): block-major, one contiguous byte range per block.

``[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]`` in the model's
dtype, or int8 with ``head_dim + 4`` bytes per row (``kv_quant.py``). One block moves as one
memcpy and is one pool object.
"""

from __future__ import annotations

import math

import torch

from kvpool.model import hugepages
from kvpool.model.config import ModelConfig
from kvpool.model.kv_quant import row_width


def kv_shape(cfg: ModelConfig, num_blocks: int, block_size: int,
             kv_dtype: torch.dtype = torch.float32) -> tuple[int, ...]:  # fmt: skip
    width = row_width(cfg.head_dim, kv_dtype)
    return (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, width)


def allocate_kv_cache(model, num_blocks: int, block_size: int) -> torch.Tensor:
    """The block-major KV tensor of ``model`` (a ``LlamaModel``: its ``kv_dtype``)."""
    shape = kv_shape(model.cfg, num_blocks, block_size, model.kv_dtype)
    return hugepages.zeros(shape, model.kv_dtype)


def kv_bytes_per_block(model, block_size: int) -> int:
    """Bytes of one block of every layer (keys and values)."""
    shape = kv_shape(model.cfg, 1, block_size, model.kv_dtype)
    return math.prod(shape) * torch.empty((), dtype=model.kv_dtype).element_size()

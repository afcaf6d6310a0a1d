"""What one decode step moves and computes: the weights its path reads (block weights up to a
layer's ``small_rows``, else the float32 ones: ``weight_formats.py``), the KV of the batch, and
the multiply-adds (the roofline's numerators)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.model.kv_quant import row_width
from kvpool.model.linear import BlockLinear


@dataclass(slots=True)
class StepCost:
    weight_bytes: int
    kv_bytes: int
    flops: float
    block_flops: float  # of which through the block kernel

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def kv_bytes_per_token(model) -> int:
    """Bytes of one token's keys and values over every layer."""
    c = model.cfg
    elem = torch.empty((), dtype=model.kv_dtype).element_size()
    return c.num_layers * 2 * c.num_kv_heads * row_width(c.head_dim, model.kv_dtype) * elem


def step_cost(model, batch: int, context: int) -> StepCost:
    """Bytes and FLOPs of one decode step of ``batch`` sequences of ``context`` tokens each
    (``model``: a ``LlamaModel``)."""
    weights = flops = block_flops = 0.0
    for lin in model.linears():
        use_blocks = isinstance(lin, BlockLinear) and batch <= lin.small_rows
        chosen = lin if use_blocks or not isinstance(lin, BlockLinear) else lin.large
        weights += chosen.nbytes
        n_k = _shape(lin)
        flops += 2.0 * batch * n_k
        if use_blocks:
            block_flops += 2.0 * batch * n_k
    c = model.cfg
    flops += 4.0 * batch * context * c.num_layers * c.num_heads * c.head_dim  # q.k and p.v
    return StepCost(int(weights), batch * context * kv_bytes_per_token(model), flops,
                    block_flops)  # fmt: skip


def _shape(lin) -> int:
    """N * K of a linear layer."""
    if isinstance(lin, BlockLinear):
        n, k = lin.weights.shape
        return n * k
    return lin.w_t.numel()

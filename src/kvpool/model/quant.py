"""Quantized weights for the linear layers: 32-element blocks along the input dimension.

Two block formats, the ones GGUF files hold (so a GGUF's own blocks are used as they are):

- ``q4``: per block a scale ``d`` and an offset ``m`` and 32 unsigned nibbles, ``w = d*q + m``
  (GGUF's Q4_1; Q4_0 maps to it exactly with ``m = -8 d``). 0.625 bytes per weight with
  float16 scales, 0.75 with float32 ones.
- ``q8``: per block a scale ``d`` and 32 signed bytes, ``w = d*q`` (GGUF's Q8_0). 1.0625 or
  1.125 bytes per weight.

``BlockWeights`` holds one matrix in the kernel's layout (``kernels/qgemm.cpp``): ``qs``
``[N, K/2]`` (q4: byte j of a block holds element j in its low nibble and j + 16 in its high
one) or ``[N, K]`` (q8), and ``d`` (and ``m``) ``[N, K/32]``. It is built from a GGUF
tensor's raw blocks (exact; the scales stay float16, as the file holds them) or from float32
weights (quantized here, float32 scales; the error measured by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

QK = 32  # weights per block
KINDS = ("q4", "q8")
# GGUF block types taken as they are: type -> (our kind, bytes per block)
GGUF_BLOCKS = {Q.Q4_0: ("q4", 18), Q.Q4_1: ("q4", 20), Q.Q8_0: ("q8", 34)}


@dataclass(slots=True)
class BlockWeights:
    kind: str  # "q4" | "q8"
    qs: torch.Tensor  # uint8 [N, K/2] (q4) or int8 [N, K] (q8)
    d: torch.Tensor  # float32 or float16 [N, K/32]
    m: torch.Tensor  # like d [N, K/32] (q4), empty (q8)

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * QK

    @property
    def nbytes(self) -> int:
        """Bytes a pass over the weights reads."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))

    def rows(self, index: torch.Tensor | np.ndarray) -> BlockWeights:
        """These weights with their rows reordered (``index``: new row i = old ``index[i]``)."""
        idx = torch.as_tensor(np.asarray(index), dtype=torch.long)
        m = self.m[idx].contiguous() if self.m.numel() else self.m
        return BlockWeights(self.kind, self.qs[idx].contiguous(), self.d[idx].contiguous(), m)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix ``[N, K]`` these blocks stand for."""
        n, k = self.shape
        if self.kind == "q4":
            q = self.qs.view(n, k // QK, QK // 2)
            vals = torch.cat([q & 0x0F, q >> 4], dim=2).float()
            w = vals * self.d.float()[..., None] + self.m.float()[..., None]
        else:
            w = self.qs.view(n, k // QK, QK).float() * self.d.float()[..., None]
        return w.reshape(n, k)


def cat_rows(parts: list[BlockWeights]) -> BlockWeights:
    """One matrix with the rows of ``parts`` stacked (fused q/k/v, gate/up)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack block weights of kinds {sorted(kinds)}")
    m = torch.cat([p.m for p in parts]) if parts[0].kind == "q4" else parts[0].m
    return BlockWeights(
        parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m
    )


def quantize(w: torch.Tensor, kind: str) -> BlockWeights:
    """Blocks of a float matrix ``[N, K]`` (K a multiple of 32): q8 symmetric (``d = max|w| /
    127``), q4 asymmetric (``d = (max - min) / 15``, ``m = min``), rounded to nearest."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    n, k = w.shape
    if k % QK:
        raise ValueError(f"the input dimension {k} is not a multiple of {QK}")
    blocks = w.detach().float().reshape(n, k // QK, QK)
    if kind == "q8":
        d = blocks.abs().amax(dim=2) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int8)
        return BlockWeights("q8", q.reshape(n, k).contiguous(), d.contiguous(), torch.empty(0))
    lo, hi = blocks.amin(dim=2), blocks.amax(dim=2)
    d = (hi - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((blocks - lo[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return BlockWeights(
        "q4", packed.reshape(n, k // 2).contiguous(), d.contiguous(), lo.contiguous()
    )


def from_gguf_blocks(data: np.ndarray, tensor_type: Q) -> BlockWeights:
    """The blocks of a GGUF tensor (``ReaderTensor.data``: ``[rows, bytes per row]`` uint8) in
    the kernel's layout, exactly (Q4_0, Q4_1, Q8_0)."""
    if tensor_type not in GGUF_BLOCKS:
        raise ValueError(f"GGUF type {tensor_type.name} is not a block format taken as is")
    kind, size = GGUF_BLOCKS[tensor_type]
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, size)
    # the scales stay float16, as the file holds them: exact, and a q4 block reads 20 bytes
    # per 32 weights instead of 24
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if tensor_type == Q.Q8_0:
        qs = blocks[..., 2:].reshape(n, -1).view(np.int8)
        return BlockWeights("q8", torch.from_numpy(qs.copy()), torch.from_numpy(d),
                            torch.empty(0))  # fmt: skip
    if tensor_type == Q.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8); -8 d is exact in float16 unless it overflows
        m = -8.0 * d.astype(np.float32)
        if np.isfinite(m.astype(np.float16)).all():
            m = m.astype(np.float16)
        else:
            d = d.astype(np.float32)
        qs = blocks[..., 2:]
    return BlockWeights(kind, torch.from_numpy(qs.reshape(n, -1).copy()), torch.from_numpy(d),
                        torch.from_numpy(np.ascontiguousarray(m)))  # fmt: skip

"""The linear layers of the decoder, one class per weight format.

Each takes activations ``x`` ``[T, K]`` and gives ``x W^T`` (``__call__``) or adds it to a
residual stream (``add_to(h, x)``, fused where the kernel can); ``prompt=True`` marks a step
with prompt tokens, whose every row takes one path whatever the step's size, so a prompt's KV
and logprobs do not depend on how the scheduler cut it into chunks. ``nbytes`` is what one pass
over the weights reads: the weight bytes each decode step streams (the roofline report).

- ``DenseLinear``: float weights through BLAS (kept transposed: ``x @ W`` runs 2-3x faster
  on CPU BLAS than ``x @ W.T`` at decode's small batch sizes); prompt steps on AMX tiles
  instead where ``with_amx`` packed them (``kernels/amx.cpp``: each operand in two bfloat16
  halves, within ~1e-5 of float32 arithmetic; chosen where faster: ``autotune.py``).
- ``BlockLinear``: 32-block q4/q8 weights (``quant.py``) through ``kernels/qgemm.cpp``, and
  up to ``GEMV_ROWS`` decode rows through ``kernels/gemv.cpp`` over a repacked copy.
  Decode-only batches of up to ``small_rows`` rows run it (a step bound by the bytes of the
  weights), larger ones run ``large`` (float32 BLAS); prompt steps run it where
  ``prompt_blocks`` (it beat BLAS on a prompt-sized batch on this machine: ``autotune.py``),
  else ``large``. With ``KVPOOL_PROMPT_ACT8=1`` (``PROMPT_ACT8``; off by default) prompt steps
  over q4 weights quantize their activations to 8 bits per 32-element block instead of 16:
  twice the products per instruction where prompt steps are bound by arithmetic (prefill
  ~1.3x), at a cost in fidelity measured in ``tests/model/test_quality_real_model.py`` and
  docs/benchmarks.md (perplexity +0.2 %, and a prompt's logprobs then depend on its chunking
  by up to ~0.1 nats, as tiny float differences flip 8-bit roundings).

Each also describes itself for the fused decode step (``spec()``: ``kernels/decode.cpp``).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kvpool.model import hugepages
from kvpool.model.quant import BlockWeights


class DenseLinear:
    __slots__ = ("amx", "bias", "kernels", "w_t")

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.w_t = w.t().contiguous()
        self.bias = bias
        self.amx: torch.Tensor | None = None  # the weights in AMX tiles, for prompt steps
        self.kernels: ModuleType | None = None

    def with_amx(self, kernels: ModuleType) -> DenseLinear:
        """Prompt steps on AMX tiles from now on (``kernels/amx.cpp``)."""
        self.kernels = kernels
        self.amx = kernels.amx_pack(self.w_t.t())
        return self

    def __call__(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        if prompt and self.amx is not None:
            return self.kernels.amx_linear(_rows(x), self.amx, bias=self.bias)
        w = self.w_t
        return torch.mm(x, w) if self.bias is None else torch.addmm(self.bias, x, w)

    def add_to(self, h: torch.Tensor, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        if prompt and self.amx is not None and h.is_contiguous():
            return self.kernels.amx_linear(_rows(x), self.amx, h, self.bias)
        return torch.addmm(h, x, self.w_t)

    @property
    def nbytes(self) -> int:
        """What one pass of a decode step reads (BLAS's float32 weights)."""
        return self.w_t.numel() * self.w_t.element_size()

    def spec(self) -> dict:
        return {"w_t": self.w_t, "bias": self.bias, "qs": None}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with contiguous rows, as the AMX kernel reads them."""
    return x if x.stride(-1) == 1 else x.contiguous()


def packed_or_none(kernels: ModuleType, bw: BlockWeights) -> torch.Tensor | None:
    """``bw`` repacked for the few-row kernel (``kernels/gemv.cpp``), or None where it does
    not run."""
    packed = kernels.gemv_pack(bw.qs, bw.kind == "q4")
    return packed if packed.numel() else None


def _lanes(prompt: bool) -> dict:
    """The kernel's lanes path computes each row alike whatever the batch's size (the per-row
    tiles round in another order): a prompt step takes it for any number of rows, so a prompt's
    results do not depend on its chunks' sizes; decode batches keep the kernel's default (the
    lanes path from ``LANES_FROM`` rows on, ``kernels.h``, where it is the faster one). A
    prompt step's activations are quantized to 8 bits where ``PROMPT_ACT8`` (q4 weights only)."""
    return prompt_args() if prompt else {}


# 8-bit activations on prompt steps (``KVPOOL_PROMPT_ACT8=1``); 16 bits, as decode has, by default
PROMPT_ACT8 = os.environ.get("KVPOOL_PROMPT_ACT8", "0") not in ("0", "false", "no", "")


def prompt_args() -> dict:
    """The kernel's arguments for a prompt step's rows."""
    return {"lanes_from": 1, "act8": PROMPT_ACT8}


def prompts_on_tiles(lin: object) -> bool:
    """Whether ``lin``'s prompt steps run on AMX tiles (itself, or the dense layer it hands
    big batches to)."""
    dense = lin if isinstance(lin, DenseLinear) else getattr(lin, "large", None)
    return isinstance(dense, DenseLinear) and dense.amx is not None


class BlockLinear:
    __slots__ = ("bias", "kernels", "large", "packed", "prompt_blocks", "small_rows", "weights")

    def __init__(self, weights: BlockWeights, kernels: ModuleType,
                 bias: torch.Tensor | None = None, large: object | None = None,
                 small_rows: int = 0, prompt_blocks: bool = False) -> None:  # fmt: skip
        self.weights = weights
        self.kernels = kernels
        self.bias = bias
        self.large = large  # a DenseLinear for big batches, or None
        self.small_rows = small_rows
        self.prompt_blocks = prompt_blocks
        # the weights repacked for the few-row kernel (kernels/gemv.cpp), or None where it
        # does not run; a second copy of the blocks, read instead of them up to GEMV_ROWS rows
        self.packed = packed_or_none(kernels, weights)

    def stream(self) -> list[torch.Tensor]:
        """What a decode step of a few rows reads, in order: the repacked blocks (or the
        blocks, where none), then the scales."""
        w = self.weights
        return [self.packed if self.packed is not None else w.qs, w.d, w.m]

    def restream(self, moved: list[torch.Tensor], qs: torch.Tensor | None) -> None:
        """Take ``stream()``'s tensors (and the blocks, where repacked) from their copies."""
        w = self.weights
        if self.packed is not None:
            self.packed = moved[0]
            self.weights = BlockWeights(w.kind, qs, moved[1], moved[2])
        else:
            self.weights = BlockWeights(w.kind, moved[0], moved[1], moved[2])

    def _big(self, x: torch.Tensor, prompt: bool) -> bool:
        if self.large is None:
            return False
        return not self.prompt_blocks if prompt else x.shape[0] > self.small_rows

    def __call__(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        if self._big(x, prompt):
            return self.large(x, prompt)  # type: ignore[operator]
        w = self.weights
        y = self.kernels.qlinear(x, w.qs, w.d, w.m, packed=self.packed, **_lanes(prompt))
        return y if self.bias is None else y.add_(self.bias)

    def add_to(self, h: torch.Tensor, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        if self._big(x, prompt):
            return self.large.add_to(h, x, prompt)  # type: ignore[union-attr]
        w = self.weights
        assert self.bias is None
        return self.kernels.qlinear(x, w.qs, w.d, w.m, h, packed=self.packed, **_lanes(prompt))

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def spec(self) -> dict:
        w = self.weights
        assert isinstance(self.large, DenseLinear), "the fused step needs the dense fallback"
        return {"w_t": self.large.w_t, "bias": self.bias, "qs": w.qs, "d": w.d, "m": w.m,
                "small_rows": self.small_rows, "packed": self.packed}  # fmt: skip


def to_huge_pages(linears: list) -> None:
    """The weights of ``linears`` (in the order a decode step reads them) copied into
    huge-page arenas (``hugepages.py``): what the few-row kernel reads (the repacked blocks and
    their scales), then the blocks as the file had them (the lanes path's), then the dense
    float32 weights; each arena in that order, so a step's reads are one stream. Each layer's
    tensors move one layer at a time, so the originals are let go as their copies are made; the
    AMX tiles of prompt steps, where packed, go into a fourth arena."""
    blocks = [lin for lin in linears if isinstance(lin, BlockLinear)]
    dense = [lin.large if isinstance(lin, BlockLinear) else lin for lin in linears]
    dense = [d for d in dense if isinstance(d, DenseLinear)]
    first = hugepages.Arena([hugepages.nbytes(t) for lin in blocks for t in lin.stream()])
    qs = hugepages.Arena([hugepages.nbytes(lin.weights.qs) for lin in blocks
                          if lin.packed is not None])  # fmt: skip
    for lin in blocks:
        moved = [first.place(t) for t in lin.stream()]
        lin.restream(moved, qs.place(lin.weights.qs) if lin.packed is not None else None)
    if dense:
        floats = hugepages.Arena([hugepages.nbytes(d.w_t) for d in dense])
        for d in dense:
            d.w_t = floats.place(d.w_t)
    tiles = [d for d in dense if d.amx is not None]
    if tiles:
        arena = hugepages.Arena([hugepages.nbytes(d.amx) for d in tiles])
        for d in tiles:
            d.amx = arena.place(d.amx)

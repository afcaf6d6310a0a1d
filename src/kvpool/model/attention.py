"""Attention over the paged, block-major KV cache (DESIGN.md §3).

The engine's KV tensor is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
New keys/values are scattered into their slots first; queries then attend to their sequence's
blocks gathered through its block table. Single-token queries (decodes) of one step are batched
into one call; multi-token chunks (prefills) attend one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kvpool.model.kv_quant import dequantize_kv, quantize_kv


@dataclass(slots=True)
class PrefillSeq:
    """A multi-token chunk of one sequence: tokens ``[start, end)`` of the flat batch."""

    start: int
    end: int
    start_pos: int  # position of the chunk's first token (= tokens already in the cache)
    block_table: torch.Tensor  # [num_blocks] long, covering start_pos + (end - start) tokens
    mask: torch.Tensor | None  # [n, ctx] bool, None when start_pos == 0 (plain causal)


@dataclass(slots=True)
class AttentionMetadata:
    """Where the step's tokens go in the cache and what each attends to."""

    slot_blocks: torch.Tensor  # [T] long: block id of each new token
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    num_decodes: int  # the first num_decodes tokens are one-token queries
    decode_block_table: torch.Tensor | None  # [B, max_blocks] long, padded with block 0
    decode_lens: torch.Tensor | None  # [B] long: context length of each decode
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool (no kernel)
    prefills: list[PrefillSeq]
    kernels: ModuleType | None = None  # compiled paged kernels (kvpool.model.kernels)


def write_kv(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Scatter this step's keys/values ([T, Hkv, D]) into one layer's cache slots (quantized
    first into an int8 cache: ``kv_quant.py``)."""
    if kv_layer.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    kv_layer[:, 0].index_put_((meta.slot_blocks, meta.slot_offsets), k)
    kv_layer[:, 1].index_put_((meta.slot_blocks, meta.slot_offsets), v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    tiles: bool = False,
) -> torch.Tensor:
    """Attention output [T, Hq * D] for queries ``q`` [T, Hq, D]; k/v are this step's [T, Hkv, D].

    ``kv_layer`` is one layer's view of the cache: ``[num_blocks, 2, block_size, Hkv, D]``.
    ``tiles``: prompt chunks attend on AMX tiles (``kernels/amx.cpp``: float32 to ~1e-5, each
    query's row alike however the prompt was cut into chunks), as the model's prompt linears do.
    """
    write_kv(kv_layer, k, v, meta)
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads, head_dim)
    nd = meta.num_decodes
    if nd and meta.kernels is not None:
        out[:nd] = meta.kernels.paged_decode_attention(
            q[:nd].contiguous(),
            kv_layer,
            meta.decode_block_table,
            meta.decode_lens,
            head_dim**-0.5,
        )
    elif nd:
        out[:nd] = _decode_attention(q[:nd], kv_layer, meta.decode_block_table, meta.decode_mask)
    for seq in meta.prefills:
        if tiles and meta.kernels is not None:
            out[seq.start : seq.end] = _prefill_on_tiles(q, k, v, kv_layer, seq, meta.kernels)
        else:
            out[seq.start : seq.end] = _prefill_attention(q, k, v, kv_layer, seq)
    return out.view(num_tokens, num_heads * head_dim)


def _gather(kv_layer: torch.Tensor, flat_table: torch.Tensor, which: int,
            dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Blocks ``flat_table`` ([n]) of keys (0) or values (1) as [n * block_size, Hkv, D]."""
    g = torch.index_select(kv_layer[:, which], 0, flat_table)  # [n, bs, Hkv, D], contiguous
    if g.dtype == torch.int8:
        g = dequantize_kv(g, dtype)
    return g.flatten(0, 1)


def _decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    batch, _max_blocks = block_table.shape
    flat = block_table.flatten()
    kv_heads, head_dim = kv_layer.shape[-2], q.shape[-1]  # int8 rows are wider than head_dim
    keys, values = (
        _gather(kv_layer, flat, i, q.dtype).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        for i in (0, 1)
    )
    # One query per sequence: fold each KV head's query group into the query-length axis
    # ([B, Hkv, G, D]), which needs no GQA expansion and runs ~2x faster than enable_gqa.
    qg = q.view(batch, kv_heads, -1, head_dim)
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)  # [B, Hkv, G, D]
    return o.reshape(batch, -1, head_dim)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, seq: PrefillSeq
) -> torch.Tensor:
    qs = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if seq.mask is None:
        keys = k[seq.start : seq.end]
        values = v[seq.start : seq.end]
    else:
        ctx = seq.mask.shape[1]
        keys = _gather(kv_layer, seq.block_table, 0, q.dtype)[:ctx]
        values = _gather(kv_layer, seq.block_table, 1, q.dtype)[:ctx]
    keys = keys.transpose(0, 1).unsqueeze(0)
    values = values.transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(
        qs, keys, values, attn_mask=seq.mask, is_causal=seq.mask is None, enable_gqa=True
    )
    return o.squeeze(0).transpose(0, 1)  # [n, Hq, D]


def _prefill_on_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                      seq: PrefillSeq, kernels: ModuleType) -> torch.Tensor:  # fmt: skip
    """``_prefill_attention`` on AMX tiles: causal from the chunk's first position on."""
    if seq.mask is None:
        keys = k[seq.start : seq.end].contiguous()
        values = v[seq.start : seq.end].contiguous()
    else:
        ctx = seq.start_pos + seq.end - seq.start
        keys = _gather(kv_layer, seq.block_table, 0, q.dtype)[:ctx]
        values = _gather(kv_layer, seq.block_table, 1, q.dtype)[:ctx]
    qs = q[seq.start : seq.end]
    return kernels.amx_prefill_attention(qs, keys, values, seq.start_pos, q.shape[-1] ** -0.5)

"""vLLM's paged KV layout and kvpool's KV object layout, and the copies between them.

vLLM's CPU backend keeps one tensor per attention layer, ``[blocks, kv_heads, block_size,
2 * head_dim]`` ("LBHNC"), but inside a block the order of keys and values is its kernel's
business (with the AVX-512 kernel the block of each head holds the keys transposed,
``[head_dim, block_size]``, then the values ``[block_size, head_dim]``; other instruction sets
may tile differently). So the connector does not assume it: ``BlockMap`` says, for every
(token in block, head, channel) of the keys and of the values, where in one block's flat
memory it lives. The connector measures it once at start-up by writing known values through
vLLM's own cache-write kernel (``connector.probe_block_map``).

A kvpool KV object holds one kvpool block (``kv_block`` tokens, 16 by default) of every layer
as ``[layers, 2, kv_block, kv_heads, head_dim]``: the slice of kvpool's own block-major cache
(``model/kv_layout.allocate_kv_cache``), so a block saved by either engine is read by the
other. A vLLM block holds ``vllm_block // kv_block`` kvpool blocks (vLLM's CPU attention wants
multiples of 32 tokens): the ``sub`` index says which.

Pure torch: vLLM is imported only inside ``probe_block_map``; the conversion is tested
without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvpool.common.hashing import kv_namespace


@dataclass(frozen=True, slots=True)
class VllmLayout:
    """The shapes on both sides."""

    num_layers: int
    kv_heads: int
    head_dim: int
    vllm_block: int  # tokens per vLLM block
    kv_block: int  # tokens per kvpool block (per pool object)

    def __post_init__(self) -> None:
        if self.kv_block <= 0 or self.vllm_block % self.kv_block:
            raise ValueError(
                f"vLLM's block of {self.vllm_block} tokens cannot be cut into kvpool blocks of "
                f"{self.kv_block}"
            )

    @property
    def subs(self) -> int:
        """kvpool blocks per vLLM block."""
        return self.vllm_block // self.kv_block

    @property
    def block_elems(self) -> int:
        """Elements of one vLLM block of one layer."""
        return self.kv_heads * self.vllm_block * 2 * self.head_dim

    def block_shape(self) -> tuple[int, ...]:
        """One pool object's payload: ``[layers, 2, kv_block, kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.kv_block, self.kv_heads, self.head_dim)

    def check_layer(self, name: str, t: torch.Tensor) -> None:
        want = (self.kv_heads, self.vllm_block, 2 * self.head_dim)
        if t.dim() != 4 or tuple(t.shape[1:]) != want or not t.is_contiguous():
            raise ValueError(
                f"vLLM KV tensor {name} is {tuple(t.shape)} (contiguous: {t.is_contiguous()}); "
                f"expected contiguous [blocks, {want[0]}, {want[1]}, {want[2]}]: a layout this "
                "connector does not know"
            )


POOL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pool_namespace(vllm_config, kv_block: int,
                   pool_dtype: str | None = None) -> tuple[str, VllmLayout]:  # fmt: skip
    """The kvpool KV namespace of vLLM's model (the string kvpool's engine builds for the same
    weights, dtype and block size: ``hashing.kv_namespace`` of the folder's fingerprint) and
    the layout on both sides. ``pool_dtype``: the dtype of the pool's objects, when it is not
    vLLM's own (the connector converts on load and save). Reads only ``model_config`` (model
    folder, ``hf_config``, dtype) and ``cache_config.block_size`` of ``vllm_config``."""
    from kvpool.model.loader import folder_fingerprint, kv_dims

    mc = vllm_config.model_config
    hf = mc.hf_config
    layers, kv_heads, head_dim = kv_dims(lambda name: getattr(hf, name, None))
    dtype = pool_dtype or str(mc.dtype).removeprefix("torch.")
    if dtype not in POOL_DTYPES:
        raise ValueError(f"pool dtype {dtype!r}: one of {', '.join(POOL_DTYPES)}")
    layout = VllmLayout(layers, kv_heads, head_dim, vllm_config.cache_config.block_size,
                        kv_block)  # fmt: skip
    ns = kv_namespace(folder_fingerprint(mc.model), dtype=dtype, block_size=kv_block,
                      num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)  # fmt: skip
    return ns, layout


@dataclass(frozen=True)
class BlockMap:
    """Where each key and value element of a vLLM block lives in its flat memory:
    ``keys[t, h, d]`` / ``values[t, h, d]`` (``[vllm_block, kv_heads, head_dim]`` offsets)."""

    keys: torch.Tensor
    values: torch.Tensor

    @cached_property
    def head_major(self) -> bool | None:
        """Whether this is a head-major map (True: keys transposed, False: not), whose whole
        blocks are copied with strided views instead of element indices; None: another map
        (found once per map)."""
        n, h, d = self.keys.shape
        for transposed in (True, False):
            keys, values = _head_major(n, h, d, transposed)
            if torch.equal(keys, self.keys) and torch.equal(values, self.values):
                return transposed
        return None

    def check(self, layout: VllmLayout) -> None:
        shape = (layout.vllm_block, layout.kv_heads, layout.head_dim)
        both = torch.cat([self.keys.reshape(-1), self.values.reshape(-1)])
        if tuple(self.keys.shape) != shape or tuple(self.values.shape) != shape or \
                not torch.equal(both.sort().values, torch.arange(layout.block_elems)):  # fmt: skip
            raise ValueError("the block map is not a permutation of one vLLM block")


def head_major_map(layout: VllmLayout, keys_transposed: bool) -> BlockMap:
    """A map of per-head blocks holding keys then values (keys ``[head_dim, block]`` when
    ``keys_transposed``, else ``[block, head_dim]``; values ``[block, head_dim]``)."""
    return BlockMap(*_head_major(layout.vllm_block, layout.kv_heads, layout.head_dim,
                                 keys_transposed))  # fmt: skip


def _head_major(n: int, h: int, d: int, keys_transposed: bool) -> tuple[torch.Tensor, ...]:
    t = torch.arange(n).view(n, 1, 1)
    hh = torch.arange(h).view(1, h, 1)
    dd = torch.arange(d).view(1, 1, d)
    base = hh * (2 * n * d)
    keys = base + (dd * n + t if keys_transposed else t * d + dd)
    values = base + n * d + t * d + dd
    return keys.contiguous(), values.contiguous()


def probe_block_map(layout: VllmLayout, dtype: torch.dtype, kv_cache_dtype: str) -> BlockMap:
    """Where vLLM's CPU cache-write kernel puts each key and value element of a block: write
    known values through it (``ops.cpu_attn_reshape_and_cache``, with the instruction set
    vLLM's CPU attention picks for this dtype and block size) into a scratch block and read
    where they landed. Values are written in base-64 digits (exact in every float dtype)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    n, h, d = layout.vllm_block, layout.kv_heads, layout.head_dim
    isa = _get_attn_isa(dtype, n, d, kv_cache_dtype)
    count = n * h * d
    ids = torch.arange(count, dtype=torch.long).view(n, h, d)
    base, digits = 64, 1
    while base**digits < 2 * count:
        digits += 1
    found = torch.zeros(layout.block_elems, dtype=torch.long)
    slots = torch.arange(n, dtype=torch.long)
    for k in range(digits):
        cache = torch.full((1, h, n, 2 * d), -1.0, dtype=dtype)
        view = cache.view(1, h, 2 * n, d)
        key_cache, value_cache = view.chunk(2, dim=2)
        keys = ((ids // base**k) % base).to(dtype)
        values = (((ids + count) // base**k) % base).to(dtype)
        ops.cpu_attn_reshape_and_cache(keys.contiguous(), values.contiguous(), key_cache,
                                       value_cache, slots, isa)  # fmt: skip
        got = cache.reshape(-1).to(torch.long)
        if (got < 0).any():
            raise ValueError(f"vLLM's cache write (isa {isa}) left part of a block unwritten")
        found += got * base**k
    where = torch.empty(2 * count, dtype=torch.long)
    where[found] = torch.arange(layout.block_elems)
    bmap = BlockMap(where[:count].view(n, h, d).clone(), where[count:].view(n, h, d).clone())
    bmap.check(layout)
    return bmap


def _linear(
    layout: VllmLayout, bmap: BlockMap, vblocks: list[int], subs: list[int]
) -> torch.Tensor:
    """Flat offsets in one layer's tensor of kvpool blocks ``(vblocks[i], subs[i])``, in the
    object's order ``[n, 2, kv_block, heads, d]`` (one 1-D index: the cheapest copy torch has)."""
    cut = (layout.subs, layout.kv_block, layout.kv_heads, layout.head_dim)
    both = torch.stack([bmap.keys.view(cut), bmap.values.view(cut)], dim=1)  # [subs, 2, ...]
    sb = torch.as_tensor(subs, dtype=torch.long)
    vb = torch.as_tensor(vblocks, dtype=torch.long).view(-1, 1, 1, 1, 1)
    return (both[sb] + vb * layout.block_elems).reshape(-1)


def gather(layout: VllmLayout, bmap: BlockMap, layers: list[torch.Tensor], vblocks: list[int],
           subs: list[int], out: torch.Tensor, rows: list[int]) -> None:  # fmt: skip
    """Copy kvpool blocks ``(vblocks[i], subs[i])`` of vLLM's ``layers`` into ``out[rows[i]]``
    (``out``: ``[slots, *layout.block_shape()]``, e.g. a staging tensor bound to the pool)."""
    vblocks, subs, rows = _whole_first(layout, bmap, layers, out, vblocks, subs, rows, False)
    if not rows:
        return
    lin = _linear(layout, bmap, vblocks, subs)
    shape = (len(rows), *layout.block_shape()[1:])
    run = _run(rows)
    at = None if run is not None else torch.as_tensor(rows, dtype=torch.long)
    for i, t in enumerate(layers):
        got = t.view(-1)[lin].view(shape)
        if run is not None:
            out[run, i] = got
        else:
            out[at, i] = got.to(out.dtype)


def _run(rows: list[int]) -> slice | None:
    """``rows`` as a slice when they are consecutive (a plain copy instead of an index)."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return None


def scatter(layout: VllmLayout, bmap: BlockMap, src: torch.Tensor, rows: list[int],
            layers: list[torch.Tensor], vblocks: list[int], subs: list[int]) -> None:  # fmt: skip
    """The inverse of ``gather``: ``src[rows[i]]`` into kvpool block ``(vblocks[i], subs[i])``."""
    vblocks, subs, rows = _whole_first(layout, bmap, layers, src, vblocks, subs, rows, True)
    if not rows:
        return
    lin = _linear(layout, bmap, vblocks, subs)
    run = _run(rows)
    at = None if run is not None else torch.as_tensor(rows, dtype=torch.long)
    for i, t in enumerate(layers):
        part = src[run, i] if run is not None else src[at, i]
        t.view(-1)[lin] = part.reshape(-1).to(t.dtype)


def _whole_first(layout: VllmLayout, bmap: BlockMap, layers: list[torch.Tensor],
                 pool: torch.Tensor, vblocks: list[int], subs: list[int], rows: list[int],
                 to_vllm: bool) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """Copy the items that make whole vLLM blocks (strided views); the others'
    ``(vblocks, subs, rows)``, for the element map."""
    whole, rest = _whole_blocks(layout, bmap, vblocks, subs)
    if whole:
        _copy_whole(layout, bmap, layers, pool, [vblocks[b[0]] for b in whole],
                    [rows[i] for b in whole for i in b], to_vllm)  # fmt: skip
    return [vblocks[i] for i in rest], [subs[i] for i in rest], [rows[i] for i in rest]


def _whole_blocks(layout: VllmLayout, bmap: BlockMap, vblocks: list[int],
                  subs: list[int]) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """The items that make up whole vLLM blocks (per block, its items by sub-block) and the
    others (indices), when the map has a head-major form; else everything is the others."""
    if bmap.head_major is None:
        return [], list(range(len(vblocks)))
    by: dict[int, dict[int, int]] = {}
    items: dict[int, list[int]] = {}
    for i, (v, s) in enumerate(zip(vblocks, subs, strict=True)):
        by.setdefault(v, {})[s] = i
        items.setdefault(v, []).append(i)
    whole, rest = [], []
    for v, got in by.items():
        if len(got) == layout.subs == len(items[v]):  # each sub-block once
            whole.append([got[s] for s in range(layout.subs)])
        else:
            rest.extend(items[v])
    return whole, sorted(rest)


def _copy_whole(layout: VllmLayout, bmap: BlockMap, layers: list[torch.Tensor],
                pool: torch.Tensor, vblocks: list[int], rows: list[int], to_vllm: bool) -> None:  # fmt: skip
    """Whole vLLM blocks ``vblocks`` <-> pool rows ``rows`` (``subs`` rows per block, in sub
    order) for a head-major map: per layer, two strided copies (keys, values), no indices."""
    transposed = bmap.head_major
    nb, S, kb = len(vblocks), layout.subs, layout.kv_block
    H, D, n = layout.kv_heads, layout.head_dim, layout.vllm_block
    # the pool side [nb, subs, 2, kb, H, D] -> keys/values [nb, subs, kb, H, D]; the vLLM side
    # per block and head [2, n * D]: keys [D, subs, kb] (transposed) or [subs, kb, D], values
    # [subs, kb, D]; ``perm`` maps the pool order onto the vLLM one
    kperm = (0, 3, 4, 1, 2) if transposed else (0, 3, 1, 2, 4)
    vperm = (0, 3, 1, 2, 4)
    run_r, run_b = _run(rows), _run(vblocks)
    at_r = None if run_r is not None else torch.as_tensor(rows, dtype=torch.long)
    at_b = None if run_b is not None else torch.as_tensor(vblocks, dtype=torch.long)
    for i, t in enumerate(layers):
        per = t.view(t.shape[0], H, 2, n * D)
        kview = per[:, :, 0].view(-1, H, D, S, kb) if transposed else \
            per[:, :, 0].view(-1, H, S, kb, D)  # fmt: skip
        vview = per[:, :, 1].view(-1, H, S, kb, D)
        if to_vllm:
            x = (pool[run_r, i] if run_r is not None else pool[at_r, i]).view(nb, S, 2, kb, H, D)
            xk, xv = x[:, :, 0].permute(kperm), x[:, :, 1].permute(vperm)
            if run_b is not None:
                kview[run_b].copy_(xk)
                vview[run_b].copy_(xv)
            else:
                kview.index_copy_(0, at_b, xk.to(t.dtype))
                vview.index_copy_(0, at_b, xv.to(t.dtype))
        else:
            k = kview[run_b] if run_b is not None else kview[at_b]
            v = vview[run_b] if run_b is not None else vview[at_b]
            if run_r is not None:
                y = pool[run_r, i].view(nb, S, 2, kb, H, D)
            else:
                y = torch.empty((nb, S, 2, kb, H, D), dtype=pool.dtype)
            y[:, :, 0].permute(kperm).copy_(k)
            y[:, :, 1].permute(vperm).copy_(v)
            if run_r is None:
                pool[at_r, i] = y.view(nb * S, 2, kb, H, D)

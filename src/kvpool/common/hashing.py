"""The block hash chain, the one implementation every part imports (DESIGN.md §3).

``h[0] = H(namespace)`` and ``h[i+1] = H(h[i] || tokens of block i as little-endian int32 ||
extra)`` with ``H`` = xxh3-128. Only full blocks are hashed. A hash is a hint, not a proof:
whoever reuses a block must compare its stored token ids with the request's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

HASH_BYTES = 16


def hash_bytes(data: bytes) -> bytes:
    """xxh3-128 digest (16 bytes) of ``data``."""
    return xxhash.xxh3_128_digest(data)


def namespace_seed(namespace: str) -> bytes:
    """``h[0]``: the root of every chain in one namespace (model + KV format)."""
    return hash_bytes(b"kvpool-ns\x00" + namespace.encode())


def hash_block(parent: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> bytes:
    """Hash of one full block given its parent's hash."""
    arr = np.asarray(tokens, dtype="<i4")
    return hash_bytes(parent + arr.tobytes() + extra)


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    seed: bytes,
    *,
    start: int = 0,
    parent: bytes | None = None,
    extra: bytes = b"",
) -> list[bytes]:
    """Hashes of the full blocks of ``tokens`` from block index ``start`` on.

    ``parent`` is the hash of block ``start - 1`` (``seed`` when ``start == 0``), so a caller
    can extend a chain it already has without rehashing its prefix.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if start > 0 and parent is None:
        raise ValueError("parent is required when start > 0")
    arr = np.asarray(tokens, dtype="<i4")
    prev = seed if start == 0 else parent
    assert prev is not None
    out: list[bytes] = []
    for i in range(start, len(arr) // block_size):
        prev = hash_bytes(prev + arr[i * block_size : (i + 1) * block_size].tobytes() + extra)
        out.append(prev)
    return out


def kv_namespace(
    model_fingerprint: str,
    *,
    dtype: str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    layout_version: int = 1,
) -> str:
    """The namespace string for KV blocks: any change of model or KV format changes all keys."""
    return (
        f"{model_fingerprint}|kv-v{layout_version}|{dtype}|bs{block_size}"
        f"|L{num_layers}|H{num_kv_heads}|D{head_dim}"
    )


def leading_true(flags: list) -> int:
    """How many leading entries of ``flags`` are true: the blocks of a chain that are present
    (a chain is usable only up to its first gap)."""
    n = 0
    for present in flags:
        if not present:
            break
        n += 1
    return n

"""The KV object format: how one KV block is stored in the pool.

Key: ``kv/<chain hash hex>`` (the chain hash already includes the namespace: model, dtype,
block size, layout; DESIGN.md §3). Value: a header, then the block's slice of the engine's KV
tensor (block-major, so one block is one contiguous range). The header is the magic ``KVPB``,
the format version, the number of tokens, the payload length (little-endian ``<4sHHQ``), then
``block_size`` int32 token ids (zero-padded). A reader compares the token ids with its own: a
hash match is a hint, the tokens are the proof.
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"KVPB"
FORMAT_VERSION = 1
KEY_PREFIX = "kv/"
_HEAD = struct.Struct("<4sHHQ")  # magic, version, number of tokens, payload bytes


def block_key(block_hash: bytes) -> str:
    """The pool key of a block."""
    return KEY_PREFIX + block_hash.hex()


def header_size(block_size: int) -> int:
    return _HEAD.size + 4 * block_size


def pack_header(token_ids: tuple[int, ...], block_size: int, payload_bytes: int) -> bytes:
    """The header of a block holding ``token_ids`` (at most ``block_size``)."""
    toks = np.asarray(token_ids, dtype="<i4")
    pad = np.zeros(block_size - len(toks), dtype="<i4")
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, len(toks), payload_bytes)
    return head + toks.tobytes() + pad.tobytes()


def header_tokens(head, block_size: int, payload_bytes: int) -> tuple[int, ...] | None:
    """The token ids a header names; None unless it is a header of this format, block size
    and payload length."""
    if len(head) < header_size(block_size):
        return None
    magic, version, n, payload = _HEAD.unpack_from(head, 0)
    if magic != MAGIC or version != FORMAT_VERSION or payload != payload_bytes:
        return None
    if n > block_size:
        return None
    return tuple(np.frombuffer(head, dtype="<i4", count=n, offset=_HEAD.size).tolist())

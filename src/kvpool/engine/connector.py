"""The KV connector seam: where an external KV store plugs into the engine.

Before a request's prefill, the engine asks the connector how many more prompt tokens
(block-aligned, after its own prefix cache) it can provide, allocates blocks for them and lets
the connector fill those blocks in the engine's KV tensor. After blocks become full the engine
hands them to the connector to save; the connector may copy them out asynchronously (so saving
overlaps the next step's compute) and reports back when it is done with each block, and until
then the engine keeps a reference so the block's bytes cannot be overwritten.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class BlockRef:
    """One full block: where it is in the KV tensor, its chain hash and its tokens."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]


class KVConnector(ABC):
    """Loads prefix blocks from, and saves full blocks to, somewhere outside the engine."""

    def bind(self, kv_cache: torch.Tensor, block_size: int, namespace: str) -> None:  # noqa: B027
        """Called once by the engine with its KV tensor (block-major, DESIGN.md §3)."""

    @abstractmethod
    def num_loadable_blocks(self, block_hashes: list[bytes], start: int) -> int:
        """How many consecutive blocks from index ``start`` of this chain it can load."""

    @abstractmethod
    def load(self, blocks: list[BlockRef], block_ids: list[int]) -> int:
        """Fill ``block_ids`` with the blocks named by ``blocks``; return how many succeeded
        (a prefix: blocks after a failed one are not used). Token ids must be verified."""

    @property
    def saves(self) -> bool:
        """Whether the engine should hand full blocks to :meth:`save`."""
        return False

    def save(self, blocks: list[BlockRef]) -> None:  # noqa: B027
        """Start saving ``blocks`` (may return before the copy is done)."""

    def poll_saved(self) -> list[int]:
        """Block ids whose save finished (or failed) since the last call."""
        return []

    def close(self) -> None:  # noqa: B027
        """Flush and release resources."""


class NoopConnector(KVConnector):
    """The default: nothing outside the engine."""

    def num_loadable_blocks(self, block_hashes: list[bytes], start: int) -> int:
        return 0

    def load(self, blocks: list[BlockRef], block_ids: list[int]) -> int:
        return 0

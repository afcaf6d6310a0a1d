"""The KV connector: where an external KV store plugs into the engine, in two roles.

The shape follows vLLM's ``KVConnectorBase_V1`` (so a vLLM connector can share a core later).

**Scheduler side** (called by the scheduler, on the engine thread, every step; must not block):

- ``get_num_new_matched_tokens(request, num_computed_tokens)`` -> ``(tokens, load_async)``: how
  many more prompt tokens (block-aligned, after the engine's own prefix hits) the connector can
  provide, and whether it loads them in the background. ``tokens`` is ``None`` when it cannot
  tell yet (a lookup in flight, the load queue full): the scheduler asks again next step and
  schedules other requests meanwhile. No side effects.
- ``request_arrived(block_hashes)``: a request was received (any thread, possibly before the
  engine thread queues it): an asynchronous connector may start its lookup now.
- ``update_state_after_alloc(request, blocks, block_ids)``: the scheduler allocated
  ``block_ids`` for ``blocks``; an asynchronous connector starts loading them now. The request
  waits in ``WAITING_FOR_REMOTE_KVS`` while other requests keep stepping.
- ``request_finished(request_id)``: the request left (aborted while loading, say): drop
  whatever is queued for it; a running load still reports back through ``get_finished``.

**Worker side** (moves the bytes):

- ``load(blocks, block_ids)``: the synchronous path (``load_async`` False): fill the blocks
  right now, inside the step; return how many succeeded (a prefix).
- ``save(blocks)``: start saving full blocks (may return at once); the engine keeps each block
  referenced until ``poll_saved`` reports it.
- ``get_finished()`` -> ``{request_id: blocks loaded}`` for asynchronous loads that ended since
  the last call (a failed or abandoned load reports 0, or the prefix that did load; the
  scheduler recomputes the rest, it never fails the request).
- ``wait_for_events(timeout)``: sleep until a load ends (the engine has nothing else to run).

Every load verifies token ids: a block whose stored tokens differ ends the loaded prefix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpool.engine.connectors.fetch_policy import FetchStats
from kvpool.engine.request import Request


@dataclass(slots=True, frozen=True)
class BlockRef:
    """One full block: where it is in the KV tensor, its chain hash and its tokens."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]


class KVConnector(ABC):
    """Loads prefix blocks from, and saves full blocks to, somewhere outside the engine.

    A subclass implements at least ``num_loadable_blocks`` and ``load`` (a synchronous
    connector); an asynchronous one overrides the scheduler-side methods and ``get_finished``.
    """

    block_size = 0

    def bind(self, kv_cache: torch.Tensor, block_size: int, namespace: str) -> None:
        """Called once by the engine with its KV tensor (block-major, DESIGN.md §3)."""
        self.block_size = block_size

    def set_cost_model(  # noqa: B027
        self, compute_s: Callable[[int], float], step_s: Callable[[], float]
    ) -> None:
        """The engine's predictions: seconds to compute ``n`` prompt tokens, and a typical
        step's seconds (a connector that fetches only when it pays compares them with its
        loads)."""

    def fetch_stats(self) -> FetchStats | None:
        """Counters of load-or-recompute decisions (None: this connector does not decide)."""
        return None

    # -- scheduler side ---------------------------------------------------------------------

    def request_arrived(self, block_hashes: list[bytes]) -> None:  # noqa: B027
        """A request whose prompt has these full blocks (those a load could provide) was
        received; called from any thread, before the scheduler sees it. An asynchronous
        connector starts its lookup here. Must not block."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(more tokens it can provide after ``num_computed_tokens``, load asynchronously?).

        The default asks ``num_loadable_blocks`` (a synchronous connector: it may block)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        start = num_computed_tokens // self.block_size
        if start >= max_blocks:
            return 0, False
        n = self.num_loadable_blocks(request.block_hashes[:max_blocks], start)
        return max(0, min(n, max_blocks - start)) * self.block_size, False

    def update_state_after_alloc(  # noqa: B027
        self, request: Request, blocks: list[BlockRef], block_ids: list[int]
    ) -> None:
        """Blocks were allocated for an asynchronous load: start it."""

    def request_finished(self, request_id: str) -> None:  # noqa: B027
        """The request left the engine: cancel what is still queued for it."""

    def request_done(self, request: Request) -> None:  # noqa: B027
        """The request finished; called on the engine thread before its blocks are freed."""

    def load_tail(self, request: Request, computed: int, block_id: int) -> int:
        """The request's first ``computed`` tokens have their KV and the rest of its prompt
        is less than a block: fill ``block_id`` with that partial block's KV now if the
        connector has it (a prefill worker's hand-off); how many tokens it holds (0: none)."""
        return 0

    # -- worker side --------------------------------------------------------------------------

    @abstractmethod
    def num_loadable_blocks(self, block_hashes: list[bytes], start: int) -> int:
        """How many consecutive blocks from index ``start`` of this chain it can load."""

    @abstractmethod
    def load(self, blocks: list[BlockRef], block_ids: list[int]) -> int:
        """Fill ``block_ids`` with the blocks named by ``blocks`` now; return how many
        succeeded (a prefix: blocks after a failed one are not used). Token ids must be
        verified."""

    def get_finished(self) -> dict[str, int]:
        """Asynchronous loads that ended since the last call: request id -> blocks loaded."""
        return {}

    def wait_for_events(self, timeout: float) -> None:  # noqa: B027
        """Sleep until an asynchronous load ends, at most ``timeout`` seconds."""

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

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def num_loadable_blocks(self, block_hashes: list[bytes], start: int) -> int:
        return 0

    def load(self, blocks: list[BlockRef], block_ids: list[int]) -> int:
        return 0

"""The transport seam: a small ABC and a name registry.

A transport moves the bytes of submitted ``PendingOp``s to or from one kind of peer and must
resolve every frame of every op it accepts (done or failed), never leave one hanging. Shared
memory and TCP ship here; an RDMA transport (e.g. through UCX) would be one more subclass
registered under its own name, picked where the hardware exists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.config import TransferConfig
from kvpool.transfer.protocol import Op
from kvpool.transfer.request import BatchHandle, PendingOp
from kvpool.transfer.segment import Segment, SegmentDescriptor
from kvpool.transfer.stats import TransferStats


@dataclass(slots=True)
class TransportContext:
    """What a transport may use of its engine."""

    config: TransferConfig
    stats: TransferStats
    owner_id: str
    boot_id: str
    local_segment: Callable[[int], Segment | None]  # by segment id, for segments we own


class Transport(ABC):
    """Moves bytes for ops whose remote segment it can reach."""

    name = "?"

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def can_reach(self, desc: SegmentDescriptor) -> bool:
        """Whether this transport can serve a segment described by ``desc``."""

    @abstractmethod
    def submit(self, ops: list[PendingOp]) -> None:
        """Start moving ``ops`` (all to the same peer); return without waiting for them."""

    def is_inline(self, nbytes: int) -> bool:
        """Whether a batch of ``nbytes`` completes inside ``submit`` (no in-flight tracking)."""
        return False

    def exchange(self, op: Op, items: list[tuple], deadline: float) -> list | None:
        """Move a small synchronous batch of one kind in the calling thread, now, before
        ``deadline`` (``time.monotonic()``): ``items`` are ``(op, local view, descriptor,
        remote offset)``, all to one peer. Per item None (moved) or the ``KVPoolError`` that
        stopped it; or None, with nothing moved, when the transport cannot do it that way
        now (the engine then submits the batch the general way)."""
        return None

    def drive(self, handle: BatchHandle) -> None:  # noqa: B027 - optional
        """Let a thread about to wait for ``handle`` do the transport's receiving itself."""

    def cancel(self, op: PendingOp) -> None:  # noqa: B027 - optional
        """Stop an op that missed its deadline; it must still resolve (as failed) soon."""

    def forget(self, desc: SegmentDescriptor) -> None:  # noqa: B027 - optional
        """Drop cached state (mappings, connections) for a segment that went away."""

    @abstractmethod
    def close(self) -> None:
        """Release everything; ops still in flight fail."""


TRANSPORTS: dict[str, type[Transport]] = {}


def register_transport(name: str) -> Callable[[type[Transport]], type[Transport]]:
    def deco(cls: type[Transport]) -> type[Transport]:
        cls.name = name
        TRANSPORTS[name] = cls
        return cls

    return deco

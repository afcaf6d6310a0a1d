"""The transfer engine: the one way KV bytes move between processes and hosts (DESIGN.md §2-3)."""

from kvpool.config import TransferConfig
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.metadata import SegmentDirectory, open_directory
from kvpool.transfer.protocol import Op
from kvpool.transfer.request import BatchHandle, State, TransferRequest, TransferStatus
from kvpool.transfer.segment import Segment, SegmentDescriptor

__all__ = [
    "BatchHandle",
    "Op",
    "Segment",
    "SegmentDescriptor",
    "SegmentDirectory",
    "State",
    "TransferConfig",
    "TransferEngine",
    "TransferRequest",
    "TransferStatus",
    "open_directory",
]

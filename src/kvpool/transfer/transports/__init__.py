"""Transports, registered by name on import: ``shm`` (same host) and ``tcp`` (anywhere)."""

from kvpool.transfer.transports import shm, tcp  # noqa: F401
from kvpool.transfer.transports.base import TRANSPORTS, Transport, register_transport

__all__ = ["TRANSPORTS", "Transport", "register_transport"]

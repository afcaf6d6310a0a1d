"""KV connectors: the two-role interface (``base``) and the pool-backed one (``store``)."""

from kvpool.engine.connectors.base import BlockRef, KVConnector, NoopConnector

__all__ = ["BlockRef", "KVConnector", "NoopConnector"]

"""The KV pool: a distributed KV-cache store (master, nodes, tiers, client). Mooncake Store's
Python API over it: ``kvpool.integrations.mooncake``."""

from kvpool.store.client import StoreClient
from kvpool.store.embedded import EmbeddedStore

__all__ = ["EmbeddedStore", "StoreClient"]

"""The KV pool: a distributed KV-cache store (master, nodes, tiers, client)."""

from kvpool.store.client import StoreClient
from kvpool.store.embedded import EmbeddedStore
from kvpool.store.mooncake_compat import MooncakeDistributedStore

__all__ = ["EmbeddedStore", "MooncakeDistributedStore", "StoreClient"]

"""The store master: metadata only (objects, allocators, eviction, leases, HA)."""

"""Repeated reads within a read lease skip the master, and never return wrong bytes."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvpool.common.errors import LeaseExpiredError, NotFoundError
from kvpool.config import MasterConfig
from kvpool.protocol.store import ObjectDesc
from kvpool.store import EmbeddedStore, StoreClient
from kvpool.store.lease_cache import LeaseCache


@pytest.fixture
def store():
    s = EmbeddedStore("32MiB", MasterConfig(lease_ttl=3.0))
    yield s
    s.close()


def master_calls(store: EmbeddedStore) -> int:
    """Gets the master answered (hits and misses; heartbeats and the like not counted)."""
    return store.service.state.counters["gets"]


def test_reads_within_a_lease_skip_the_master(store):
    value = os.urandom(100_000)
    store.put("k", value)
    buf = np.zeros(100_000, np.uint8)
    assert store.get_into("k", buf) == 100_000
    before = master_calls(store)
    for _ in range(5):
        assert store.get_into("k", buf) == 100_000 and buf.tobytes() == value
        assert store.get("k") == value
    assert store.batch_get(["k", "missing"]) == [value, None]
    assert master_calls(store) == before + 1  # only the batch's miss asked the master
    assert store.leases.hits >= 11
    time.sleep(2.1)  # past lease_ttl - margin: ask again (and renew the lease)
    assert store.get("k") == value
    assert master_calls(store) == before + 2


def test_a_forced_remove_and_new_value_is_detected_by_the_checksum(store):
    old, new = b"a" * 50_000, b"b" * 50_000
    store.put("k", old)
    assert store.get("k") == old  # cached now
    other = StoreClient(store.server.address, store.engine, lease_cache=False)
    other.remove("k", force=True)
    other.put("k", new)  # same size: most likely the same place
    assert store.get("k") == new  # the stale location failed its checksum; asked again
    other.remove("k", force=True)
    store.leases.drop("k")
    with pytest.raises(NotFoundError):
        store.get("k")


def test_own_remove_forgets_the_lease(store):
    store.put("k", b"x" * 10)
    assert store.get("k") == b"x" * 10
    with pytest.raises(LeaseExpiredError):  # leased by our get: refused without force
        store.remove("k")
    assert store.leases.get("k") is None
    store.remove("k", force=True)
    with pytest.raises(NotFoundError):
        store.get("k")


def test_cache_bounds_and_switch():
    cache = LeaseCache(max_entries=3)
    now = time.monotonic()
    for i in range(5):
        cache.put(f"k{i}", ObjectDesc(f"k{i}", i, (), lease_ttl=10.0), now)
    assert [cache.get(f"k{i}") for i in range(2)] == [None, None]
    assert cache.get("k4").size == 4
    cache.put("short", ObjectDesc("short", 1, (), lease_ttl=0.5), now)  # under the margin
    assert cache.get("short") is None
    off = LeaseCache(enabled=False)
    off.put("k", ObjectDesc("k", 1, (), lease_ttl=10.0), now)
    assert off.get("k") is None

"""The store end to end in embedded mode (master, node and client in this process)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvpool.common.errors import AlreadyExistsError, BadRequestError, NotFoundError
from kvpool.config import MasterConfig
from kvpool.store import EmbeddedStore


@pytest.fixture
def store():
    s = EmbeddedStore("32MiB", MasterConfig(lease_ttl=0.2, max_object_bytes="16MiB"))
    yield s
    s.close()


@pytest.mark.parametrize("size", [1, 4096, 65537, 1 << 20, 8 << 20])
def test_values_read_back_byte_identical(store, size):
    value = os.urandom(size)
    store.put(f"k{size}", value)
    assert store.get(f"k{size}") == value
    buf = np.zeros(size + 10, np.uint8)
    assert store.get_into(f"k{size}", buf) == size
    assert buf[:size].tobytes() == value and not buf[size:].any()
    assert store.get_size(f"k{size}") == size


def test_tensor_values_and_batches(store):
    t = torch.arange(1000, dtype=torch.float32)
    store.put_from("tensor", t)
    out = torch.zeros(1000, dtype=torch.float32)
    store.get_into("tensor", out)
    assert torch.equal(out, t)
    keys = [f"b{i}" for i in range(20)]
    values = [os.urandom(100 + i * 1000) for i in range(20)]
    assert store.batch_put(keys, values) == [None] * 20
    assert store.batch_get([*keys, "missing"]) == [*values, None]
    assert store.batch_exists(["b0", "missing"]) == [True, False]
    bufs = [bytearray(len(v)) for v in values]
    assert store.batch_get_into(keys, bufs) == [len(v) for v in values]
    assert [bytes(b) for b in bufs] == values


def test_errors_are_typed(store):
    store.put("dup", b"1")
    with pytest.raises(AlreadyExistsError):
        store.put("dup", b"2")
    assert store.get("dup") == b"1"  # the first value stays
    with pytest.raises(NotFoundError):
        store.get("unknown")
    with pytest.raises(BadRequestError):
        store.put("", b"x")
    with pytest.raises(BadRequestError):
        store.put("empty", b"")
    with pytest.raises(BadRequestError):
        store.put("huge", b"x" * (17 << 20))  # over max_object_bytes
    results = store.batch_put(["dup", "new"], [b"a", b"b"])
    assert isinstance(results[0], AlreadyExistsError) and results[1] is None


def test_remove_and_leases(store):
    import time

    store.put("r", b"value")
    store.get("r")  # leased for 0.2 s
    with pytest.raises(Exception, match="leased"):
        store.remove("r")
    time.sleep(0.3)
    store.remove("r")
    assert not store.exists("r")
    with pytest.raises(NotFoundError):
        store.get("r")


def test_eviction_under_pressure_keeps_serving(store):
    value = os.urandom(1 << 20)
    for i in range(60):  # 60 MiB through a 32 MiB pool
        store.put(f"e{i}", value)
    stats = store.stats()
    assert stats["evictions"] > 0 and stats["dram_used_bytes"] <= 32 << 20
    assert store.get("e59") == value  # the newest are there
    present = [i for i in range(60) if store.exists(f"e{i}")]
    assert all(store.get(f"e{i}") == value for i in present[-3:])


def test_node_index_follows_commits(store):
    import time

    store.put("idx", b"abc")
    deadline = time.monotonic() + 5
    while "idx" not in store.node.index and time.monotonic() < deadline:
        time.sleep(0.05)
    _, offset, size, _ = store.node.index["idx"]
    assert size == 3
    assert store.node.segment.array[offset : offset + 3].tobytes() == b"abc"


def test_ssd_tier_offloads_and_promotes(tmp_path):
    import time

    cfg = MasterConfig(lease_ttl=0.05, cooldown=0.2, high_watermark=0.9, low_watermark=0.6)
    store = EmbeddedStore("8MiB", cfg, ssd_path=str(tmp_path / "ssd"), ssd_size="64MiB")
    try:
        values = {f"s{i}": os.urandom(1 << 20) for i in range(24)}  # 24 MiB through 8 MiB DRAM
        for k, v in values.items():
            store.put(k, v)
        stats = store.stats()
        assert stats["offloads"] > 0 and stats["ssd_used_bytes"] > 0
        assert stats["dram_used_bytes"] <= 8 << 20
        time.sleep(0.3)  # past the cool-down and leases
        for k, v in values.items():
            assert store.get(k) == v  # from DRAM or SSD, byte for byte
        assert store.stats()["promotions"] > 0
        files = list((tmp_path / "ssd").iterdir())
        assert len(files) == 1 and files[0].stat().st_size == 64 << 20
    finally:
        store.close()
    assert not list((tmp_path / "ssd").iterdir())  # the tier's file goes with the node


def test_batch_tiers_says_where_a_read_would_come_from(tmp_path):
    import time

    cfg = MasterConfig(lease_ttl=0.05, cooldown=0.2, high_watermark=0.9, low_watermark=0.6)
    store = EmbeddedStore("8MiB", cfg, ssd_path=str(tmp_path / "ssd"), ssd_size="64MiB")
    try:
        keys = [f"t{i}" for i in range(16)]  # 16 MiB through 8 MiB of DRAM: some go to SSD
        for k in keys:
            store.put(k, os.urandom(1 << 20))
        time.sleep(0.5)  # the offloads the puts started have finished (nothing reads meanwhile)
        tiers = store.batch_tiers([*keys, "missing"])
        assert tiers[-1] is None and set(tiers[:-1]) == {"dram", "ssd"}
        for k, t in zip(keys, tiers, strict=False):
            in_dram = any(r.tier == "dram" for r in store.replicas(k).replicas)
            assert t == ("dram" if in_dram else "ssd")
        assert store.batch_exists(keys) == [True] * len(keys)
        for bad in ("t0", [1, 2], None):  # a clear 400, never an internal error
            with pytest.raises(BadRequestError):
                store.master.call("batch_tiers", bad)
        with pytest.raises(BadRequestError):
            store.master.call("batch_put_start", [[7, 10]])
    finally:
        store.close()


def test_index_deltas_are_resent_until_acknowledged():
    """A heartbeat reply that never reaches the node loses no delta (at-least-once)."""
    import time

    from kvpool.store.master.tracked import TrackedState

    state = TrackedState(MasterConfig(), time.monotonic)
    state.deltas["n"] += [["add", "a", 1, "s", 0, None], ["add", "b", 1, "s", 8, None]]
    sent, seq = state.take_deltas("n", None, 0)  # this reply is lost
    assert [d[1] for d in sent] == ["a", "b"] and seq == 2
    again, seq = state.take_deltas("n", None, 0)  # so the node acks nothing: resent
    assert again == sent and seq == 2
    state.deltas["n"].append(["del", "a", 0, "s", 0, None])
    epoch = state.stream_epoch("n")
    rest, seq = state.take_deltas("n", epoch, 2)  # a and b acknowledged
    assert [d[0] for d in rest] == ["del"] and seq == 3
    assert state.take_deltas("n", "another-master", 3) == (rest, 3)  # foreign acks ignored
    assert state.take_deltas("n", epoch, 3) == ([], 3)


def test_an_ack_of_a_previous_life_of_the_node_discards_nothing():
    """The node is dropped (a restart under the same id, missed heartbeats) and its delta
    seqs restart at 1: its ack of seq 3 from before must not discard the new stream's deltas
    (they would never reach its index: objects lost at the next fail-over, removed ones back
    as stale entries overlapping new allocations)."""
    import time

    from kvpool.store.master.tracked import TrackedState

    state = TrackedState(MasterConfig(), time.monotonic)
    state.deltas["n"] += [["add", k, 1, "s", 8 * i, None] for i, k in enumerate("abc")]
    old_epoch = state.stream_epoch("n")
    assert state.take_deltas("n", old_epoch, 3) == ([], 3)
    state.drop_node("n")
    state.deltas["n"] += [["add", "x", 1, "s", 0, None], ["del", "b", 0, "s", 8, None]]
    sent, seq = state.take_deltas("n", old_epoch, 3)  # the node still names its old stream
    assert [d[1] for d in sent] == ["x", "b"] and seq == 2
    assert state.stream_epoch("n") != old_epoch

"""The Mooncake Store methods beyond put/get: ReplicateConfig and pins, upserts, buffers,
byte ranges, tensors, replica descriptors, config-dict set-up, health, bulk removal.
Real master, real nodes, real transfer engine (shm and TCP)."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
from mooncake_helpers import HAS_LEASE, INVALID, LEASE_TTL, NOT_FOUND, STATE, MiB, payload

from kvpool.common.rpc import RpcClient
from kvpool.config import MasterConfig
from kvpool.integrations.mooncake import (
    BufferHandle,
    MooncakeDistributedStore,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    mooncake_size,
    tensors,
)
from kvpool.store.master.service import MasterService


def wait_lease() -> None:
    time.sleep(LEASE_TTL * 1.5)


# -- ReplicateConfig and sizes ---------------------------------------------------------------


def test_replicate_config_defaults_and_soft_pin_spellings():
    config = ReplicateConfig()
    assert (config.replica_num, config.soft_pin_action, config.soft_pin_ttl_ms) == (
        1,
        SoftPinAction.PRESERVE,
        None,
    )
    assert (config.with_hard_pin, config.preferred_segment, config.preferred_segments) == (
        False,
        "",
        [],
    )
    assert config.with_soft_pin is False
    config.with_soft_pin = True
    assert config.soft_pin_action is SoftPinAction.ENABLE
    config.soft_pin_ttl_ms = 1500
    options = config.options()
    assert options.soft_pin and options.pin_ttl == 1.5 and not options.hard_pin
    config.replica_num = 0
    with pytest.raises(ValueError, match="replica_num"):
        config.options()


@pytest.mark.parametrize(
    ("text", "size"),
    [(0, 0), (4096, 4096), ("16 MB", 16 * MiB), ("16MB", 16 * MiB), ("1.5 GB", 3 << 29),
     ("512kb", 512 << 10), ("100", 100), (" 2 M ", 2 * MiB), ("1 TB", 1 << 40)],
)  # fmt: skip
def test_mooncake_sizes(text, size):
    assert mooncake_size(text) == size


@pytest.mark.parametrize("bad", [-1, "", "MB", "16 XB", "1e3", None, True, 1.5, "-4 MB"])
def test_mooncake_sizes_refused(bad):
    with pytest.raises(ValueError):
        mooncake_size(bad)


# -- set-up from a config dict, health ------------------------------------------------------------


def test_setup_from_config_dict_and_health(master):
    store = MooncakeDistributedStore()
    assert store.health_check() == 1  # not set up
    config = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "16 MB",
        "local_buffer_size": "16MB",
        "protocol": "tcp",
        "master_server_addr": master,
        "tenant_id": "ignored",
    }
    assert store.setup(config) == 0
    try:
        assert store.health_check() == 0
        stats = RpcClient(master).call("stats")
        assert stats["dram_capacity_bytes"] >= 16 * MiB  # the segment is there
        assert store.put("cfg-dict", b"value") == 0 and store.get("cfg-dict") == b"value"
        assert store.remove("cfg-dict", force=True) == 0
    finally:
        assert store.close() == 0
    assert store.health_check() == 1
    other = MooncakeDistributedStore()
    assert other.setup({**config, "global_segment_size": "16 XB"}) == INVALID
    assert other.setup({"metadata_server": "P2PHANDSHAKE", "master_server_addr": master}) == INVALID
    assert other.health_check() == 1


def test_health_check_sees_a_dead_master():
    service = MasterService()
    server = service.serve()
    store = MooncakeDistributedStore()
    try:
        assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", server.address) == 0
        assert store.health_check() == 0
        server.close()
        assert store.health_check() == 2
    finally:
        store.close()
        service.close()


# -- upserts ----------------------------------------------------------------------------------


def test_upsert_replaces_and_readers_see_the_new_value(pool):
    holder, client = pool
    first, second, third = payload(3000, 1), payload(70_000, 2), payload(10, 3)
    assert client.upsert("up", first) == 0  # a new key: a plain put
    assert holder.get("up") == first  # now leased by that read
    assert client.upsert("up", second) == 0  # leased: replaced anyway (as Mooncake)
    assert holder.get("up") == second and client.get_size("up") == len(second)
    assert client.put("up", third) == 0 and client.get("up") == second  # put keeps
    assert client.upsert_batch(["up", "up-b"], [third, first]) == 0
    assert holder.get_batch(["up", "up-b"]) == [third, first]
    assert client.upsert_parts("up", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert holder.get("up") == b"abcdef"


def test_upsert_from_registered_memory(pool):
    _, client = pool
    src = np.frombuffer(payload(MiB, 4), dtype=np.uint8).copy()
    assert client.register_buffer(src.ctypes.data, src.nbytes) == 0
    try:
        assert client.put("up-zc", b"old") == 0
        assert client.upsert_from("up-zc", src.ctypes.data, 4096) == 0
        assert client.get("up-zc") == src[:4096].tobytes()
        ptrs, sizes = [src.ctypes.data, src.ctypes.data + 100], [1000, 2000]
        assert client.batch_upsert_from(["up-zc", "up-zc2"], ptrs, sizes) == [0, 0]
        assert client.get_batch(["up-zc", "up-zc2"]) == [
            src[:1000].tobytes(),
            src[100:2100].tobytes(),
        ]
    finally:
        assert client.unregister_buffer(src.ctypes.data) == 0


def test_old_space_is_reclaimed_after_upserts(master, pool):
    holder, client = pool
    rpc = RpcClient(master)
    before = rpc.call("stats")["dram_used_bytes"]
    for i in range(20):
        assert client.upsert("up-churn", payload(MiB, i)) == 0
        assert holder.get("up-churn") == payload(MiB, i)
    deadline = time.monotonic() + 10 * LEASE_TTL + 5
    while rpc.call("stats")["dram_used_bytes"] > before + 2 * MiB and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rpc.call("stats")["dram_used_bytes"] <= before + 2 * MiB  # 20 MiB written, 1 kept
    assert client.remove("up-churn", force=True) == 0


# -- buffers and ranges -----------------------------------------------------------------------


def test_get_buffer(pool):
    holder, client = pool
    value = payload(200_000, 5)
    assert holder.put("buf", value) == 0
    handle = client.get_buffer("buf")
    assert isinstance(handle, BufferHandle)
    assert handle.size() == len(value) and handle.ptr() != 0
    assert bytes(memoryview(handle)) == value
    assert (
        np.ctypeslib.as_array((np.ctypeslib.ctypes.c_ubyte * 16).from_address(handle.ptr()))[
            :16
        ].tobytes()
        == value[:16]
    )
    assert client.get_buffer("buf-missing") is None
    got = client.batch_get_buffer(["buf", "buf-missing", "buf"])
    assert [g is None for g in got] == [False, True, False]
    assert bytes(got[0]) == bytes(got[2]) == value


def test_get_into_ranges(pool):
    holder, client = pool
    a, b = payload(100_000, 6), payload(50_000, 7)
    assert holder.put_batch(["rng-a", "rng-b"], [a, b]) == 0
    dst = np.zeros(64 * 1024, dtype=np.uint8)
    assert client.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    try:
        got = client.get_into_ranges(
            [dst.ctypes.data],
            [["rng-a", "rng-b", "rng-missing"]],
            [[[0, 1000], [5000], [9000]]],  # destination offsets
            [[[99_000, 0], [49_990], [0]]],  # source offsets
            [[[1000, 500], [10], [8]]],
        )
        assert got[0][0] == [1000, 500] and got[0][1] == [10]
        assert got[0][2] == [NOT_FOUND]
        assert dst[:1000].tobytes() == a[99_000:]
        assert dst[1000:1500].tobytes() == a[:500]
        assert dst[5000:5010].tobytes() == b[49_990:]
        past_end = client.get_into_ranges(
            [dst.ctypes.data], [["rng-b"]], [[[0]]], [[[49_999]]], [[[2]]]
        )
        assert past_end == [[[INVALID]]]
        outside = client.get_into_ranges(
            [dst.ctypes.data], [["rng-b"]], [[[64 * 1024 - 4]]], [[[0]]], [[[8]]]
        )
        assert outside == [[[INVALID]]]
        ragged = client.get_into_ranges([dst.ctypes.data], [["rng-b"]], [[[0, 8]]], [[[0]]],
                                        [[[4, 4]]])  # fmt: skip
        assert ragged == [[[INVALID, INVALID]]]
    finally:
        assert client.unregister_buffer(dst.ctypes.data) == 0


# -- tensors ----------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
          torch.uint16, torch.float8_e4m3fn]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_round_trip_keeps_dtype_and_shape(pool, dtype):
    holder, client = pool
    g = torch.Generator().manual_seed(1)
    src = (torch.randn(3, 5, 7, generator=g) * 10).to(dtype)
    key = f"tensor-{dtype}"
    assert client.put_tensor(key, src) == 0
    got = holder.get_tensor(key)
    assert got.dtype == dtype and got.shape == src.shape and torch.equal(got, src)
    got.view(torch.uint8).bitwise_not_()  # its own memory: writable, and not the pool's
    assert torch.equal(holder.get_tensor(key), src)


def test_tensor_forms(pool):
    holder, client = pool
    strided = torch.arange(60, dtype=torch.float32).reshape(6, 10)[:, ::2]  # not contiguous
    scalar, empty = torch.tensor(3.5, dtype=torch.float64), torch.zeros(0, 4)
    keys = ["t-strided", "t-scalar", "t-empty"]
    assert client.batch_put_tensor(keys, [strided, scalar, empty]) == [0, 0, 0]
    got = holder.batch_get_tensor([*keys, "t-missing"])
    assert torch.equal(got[0], strided) and got[1].shape == () and got[1].item() == 3.5
    assert got[2].shape == (0, 4) and got[3] is None
    assert client.put_tensor("t-strided", torch.ones(2)) == 0  # put keeps the first
    assert torch.equal(client.get_tensor("t-strided"), strided)
    assert client.upsert_tensor("t-strided", torch.ones(2)) == 0
    assert torch.equal(client.get_tensor("t-strided"), torch.ones(2))
    assert client.batch_upsert_tensor(["t-scalar"], [torch.zeros(3, dtype=torch.int8)]) == [0]
    assert client.get_tensor("t-scalar").dtype == torch.int8
    assert client.put_tensor("t-bad", "not a tensor") == INVALID
    assert client.put_tensor("t-bad", torch.zeros(*[1] * 9)) == INVALID  # 9 dims
    assert (
        client.put_tensor("t-bad", torch.zeros(2, dtype=torch.complex64)) == INVALID
    )  # as Mooncake
    assert client.put("t-raw", b"raw bytes, no header") == 0
    assert client.get_tensor("t-raw") is None  # not a tensor value: None, not garbage
    assert client.batch_put_tensor(["a", "b"], [torch.ones(1)]) == [INVALID, INVALID]


def test_tensor_zero_copy_forms(pool):
    holder, client = pool
    src = torch.randn(16, 32, dtype=torch.float16)
    assert holder.put_tensor("t-zc", src) == 0
    buf = np.zeros(4096, dtype=np.uint8)
    assert client.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    try:
        got = client.get_tensor_into("t-zc", buf.ctypes.data, buf.nbytes)
        assert torch.equal(got, src)
        n = tensors.HEADER_BYTES + src.numel() * 2
        assert client.put_tensor_from("t-zc-copy", buf.ctypes.data, n) == 0  # header + data
        assert torch.equal(holder.get_tensor("t-zc-copy"), src)
        assert client.put_tensor_from("t-zc-bad", buf.ctypes.data, n - 1) == INVALID
        assert client.get_tensor_into("t-zc", buf.ctypes.data, 100) is None  # too small
        assert client.get_tensor_into("t-none", buf.ctypes.data, 4096) is None
        got = client.batch_get_tensor_into(["t-zc", "t-none"], [buf.ctypes.data] * 2, [2048] * 2)
        assert torch.equal(got[0], src) and got[1] is None
    finally:
        assert client.unregister_buffer(buf.ctypes.data) == 0


# -- replica descriptors, preferred segments, several replicas ---------------------------------


@pytest.fixture(scope="module")
def three_holders(master, pool):
    """Two more holders (so there are three nodes), closed at the end."""
    extra = [MooncakeDistributedStore() for _ in range(2)]
    for store in extra:
        assert store.setup("localhost", "P2PHANDSHAKE", 16 * MiB, 0, "tcp", "", master) == 0
    yield [pool[0], *extra]
    for store in extra:
        assert store.close() == 0


def test_replica_descriptors_and_preferred_segment(pool, three_holders):
    _, client = pool
    names = [h.get_hostname() for h in three_holders]
    assert len(set(names)) == 3 and all(re.fullmatch(r"localhost:\d+", n) for n in names)
    for target in names:
        config = ReplicateConfig()
        config.preferred_segment = target
        key = f"pref-{target}"
        assert client.put(key, payload(5000), config) == 0
        (desc,) = client.get_replica_desc(key)
        assert desc.status is ReplicaStatus.COMPLETE and desc.is_memory_replica()
        mem = desc.get_memory_descriptor().buffer_descriptor
        assert mem.transport_endpoint == target and mem.size == 5000
    config = ReplicateConfig()
    config.replica_num = 3
    assert client.put("three", payload(9000), config) == 0
    descs = client.get_replica_desc("three")
    endpoints = {d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in descs}
    assert endpoints == set(names)
    assert client.get_replica_desc("nope") == []
    batch = client.batch_get_replica_desc(["three", "nope", f"pref-{names[1]}"])
    assert set(batch) == {"three", f"pref-{names[1]}"}  # missing keys left out, as Mooncake


def test_prefer_alloc_in_same_node(pool, three_holders):
    for store in three_holders:
        config = ReplicateConfig()
        config.prefer_alloc_in_same_node = True
        key = f"same-{store.get_hostname()}"
        assert store.put(key, payload(4000), config) == 0
        (desc,) = store.get_replica_desc(key)
        assert desc.get_memory_descriptor().buffer_descriptor.transport_endpoint == (
            store.get_hostname()
        )


# -- bulk removal -----------------------------------------------------------------------------


def test_remove_by_regex_and_remove_all(master):
    service = MasterService(MasterConfig(lease_ttl=30))
    server = service.serve()
    store = MooncakeDistributedStore()
    try:
        assert store.setup("localhost", "P2PHANDSHAKE", 8 * MiB, 0, "tcp", "", server.address) == 0
        keys = [f"layer-{i}/block-{j}" for i in range(3) for j in range(4)]
        assert store.put_batch([*keys, "other"], [b"v"] * (len(keys) + 1)) == 0
        assert store.remove_by_regex("(") == INVALID  # a bad pattern
        assert store.remove_by_regex(r"^layer-1/") == 4
        assert store.batch_is_exist(["layer-1/block-0", "layer-0/block-0"]) == [0, 1]  # leases
        assert store.get("layer-2/block-3") == b"v"  # leased now
        assert store.remove_by_regex(r"layer-2") == 3  # the leased one stays
        assert store.is_exist("layer-2/block-3") == 1
        assert store.remove("layer-2/block-3") == HAS_LEASE
        assert store.remove_by_regex(r"block-3$", force=True) == 2  # layer-0 and the leased one
        assert store.get("other") == b"v"
        assert store.remove_all() == 2  # layer-0/block-1..2; block-0 and "other" are leased
        assert store.remove_all(force=True) == 2
        assert store.remove_all() == 0 and store.get("other") == b""
    finally:
        store.close()
        server.close()
        service.close()


# -- pins and eviction ------------------------------------------------------------------------


@pytest.fixture
def small_pool():
    """A master and one 8 MiB node (eviction from 90% down to 80% of it)."""
    service = MasterService(MasterConfig(lease_ttl=0.2))
    server = service.serve()
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 8 * MiB, 0, "tcp", "", server.address) == 0
    yield store, RpcClient(server.address)
    store.close()
    server.close()
    service.close()


def _fill(store, prefix: str, count: int, size: int = 512 << 10) -> None:
    for i in range(count):
        assert store.put(f"{prefix}-{i}", payload(size, i)) == 0


def test_hard_pin_is_never_evicted(small_pool):
    store, rpc = small_pool
    config = ReplicateConfig()
    config.with_hard_pin = True
    assert store.put("hard", payload(MiB, 1), config) == 0
    _fill(store, "fill", 40)  # 20 MiB through an 8 MiB node
    assert rpc.call("stats")["evictions"] > 0
    assert store.get("hard") == payload(MiB, 1)
    time.sleep(0.3)  # the lease of that read ends
    assert store.remove("hard") == 0  # a remove still removes it


def test_soft_pin_goes_last_and_its_ttl_ends(small_pool):
    store, rpc = small_pool
    soft = ReplicateConfig()
    soft.with_soft_pin = True
    assert store.put("soft", payload(MiB, 2), soft) == 0
    _fill(store, "a", 40)
    assert store.get("soft") == payload(MiB, 2)  # the others went first
    timed = ReplicateConfig()
    timed.soft_pin_action = SoftPinAction.ENABLE
    timed.soft_pin_ttl_ms = 200
    assert store.put("soft-ttl", payload(MiB, 3), timed) == 0
    time.sleep(0.5)  # its pin is over
    before = rpc.call("stats")["evictions"]
    _fill(store, "b", 40)
    assert rpc.call("stats")["evictions"] > before
    assert store.is_exist("soft-ttl") == 0  # evicted like any other object
    assert store.get("soft") == payload(MiB, 2)


def test_operations_after_close_answer_state_errors(master):
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0
    assert store.close() == 0
    assert store.upsert("x", b"y") == STATE
    assert store.get_buffer("x") is None and store.get_tensor("x") is None
    assert store.put_tensor("x", torch.ones(1)) == STATE
    assert store.remove_all() == STATE and store.remove_by_regex("x") == STATE
    assert store.get_replica_desc("x") == []


def test_forced_removes_need_the_admin_token(monkeypatch):
    monkeypatch.setenv("KVPOOL_AUTH_TOKEN", "cluster-secret")
    monkeypatch.setenv("KVPOOL_ADMIN_TOKEN", "admin-secret")
    service = MasterService(MasterConfig(lease_ttl=30))
    server = service.serve()
    admin, member = MooncakeDistributedStore(), MooncakeDistributedStore()
    try:
        assert admin.setup("localhost", "P2PHANDSHAKE", 8 * MiB, 0, "tcp", "", server.address) == 0
        monkeypatch.delenv("KVPOOL_ADMIN_TOKEN")
        assert member.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", server.address) == 0
        assert member.put("leased", b"v") == 0 and member.get("leased") == b"v"
        assert member.remove("leased") == HAS_LEASE
        assert member.remove("leased", force=True) == -1  # refused: not an admin
        assert member.remove_all(force=True) == -1 and member.is_exist("leased") == 1
        assert admin.remove("leased", force=True) == 0
        assert member.get("leased") == b""
    finally:
        member.close()
        admin.close()
        server.close()
        service.close()

"""MooncakeDistributedStore over a real master, real nodes and the real transfer engine."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from mooncake_helpers import HAS_LEASE, INVALID, LEASE_TTL, NOT_FOUND, MiB, payload
from mooncake_helpers import STATE as NOT_READY

from kvpool.common.rpc import RpcClient
from kvpool.integrations.mooncake import MooncakeDistributedStore, directory_url
from kvpool.store.master.service import MasterService
from kvpool.transfer.metadata_server import MetadataServer


def test_pure_client_contributes_no_memory(pool, master):
    stats = RpcClient(master).call("stats")
    assert stats["nodes"] == 1
    assert stats["dram_capacity_bytes"] == 64 * MiB


@pytest.mark.parametrize("size", [1, 100, 4096, 65_537, MiB, 4 * MiB])
def test_put_get_round_trip(pool, size):
    holder, client = pool
    for writer, reader, tag in ((client, holder, "c2h"), (holder, client, "h2c")):
        key, value = f"rt-{tag}-{size}", payload(size)
        assert writer.put(key, value) == 0
        assert reader.get(key) == value
        assert writer.get(key) == value
        assert reader.get_size(key) == size
        assert reader.is_exist(key) == 1


def test_missing_key(pool):
    _, client = pool
    assert client.get("nope") == b""
    assert client.is_exist("nope") == 0
    assert client.get_size("nope") == NOT_FOUND
    assert client.remove("nope") == NOT_FOUND
    assert client.get_batch(["nope", "nope2"]) == [b"", b""]


def test_batch_ops(pool):
    holder, client = pool
    keys = [f"batch-{i}" for i in range(5)]
    values = [payload(1000 * (i + 1), i) for i in range(5)]
    assert client.put_batch(keys, values) == 0
    assert holder.get_batch(keys) == values
    assert client.get_batch([keys[0], "batch-missing", keys[4]]) == [values[0], b"", values[4]]
    assert client.batch_is_exist([keys[1], "batch-missing", keys[3]]) == [1, 0, 1]
    assert client.batch_remove([keys[0], "batch-missing"]) == [HAS_LEASE, NOT_FOUND]  # read
    assert client.batch_remove([keys[0], keys[1]], force=True) == [0, 0]


def test_duplicate_put_returns_zero_and_keeps_first(pool):
    holder, client = pool
    first, second = payload(3000, 1), payload(5000, 2)
    assert client.put("dup", first) == 0
    assert holder.put("dup", second) == 0
    assert client.put_batch(["dup", "dup-new"], [second, second]) == 0
    assert client.get("dup") == first
    assert client.get("dup-new") == second
    assert client.put_parts("parts", b"Hello, ", bytearray(b"World"), memoryview(b"!")) == 0
    assert holder.get("parts") == b"Hello, World!"


def test_remove_codes(pool):
    _, client = pool
    assert client.put("rm", b"x" * 100) == 0
    assert client.remove("rm") == 0  # never read: no lease
    assert client.is_exist("rm") == 0
    assert client.remove("rm") == NOT_FOUND
    assert client.put("rm-leased", b"y" * 100) == 0
    assert client.get("rm-leased") == b"y" * 100  # grants a lease of LEASE_TTL
    assert client.remove("rm-leased") == HAS_LEASE
    deadline = time.monotonic() + 10 * LEASE_TTL
    while (code := client.remove("rm-leased")) == HAS_LEASE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert code == 0
    assert client.remove("rm-leased") == NOT_FOUND
    assert client.put("rm-forced", b"z") == 0 and client.get("rm-forced") == b"z"
    assert client.remove("rm-forced", force=True) == 0


def test_zero_copy_numpy_pointers(pool):
    holder, client = pool
    src = np.frombuffer(payload(2 * MiB, 7), dtype=np.uint8).copy()
    dst = np.zeros(2 * MiB, dtype=np.uint8)
    assert client.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert client.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert client.put_from("zc-np", src.ctypes.data, MiB) == 0
    assert client.put_from("zc-np-off", src.ctypes.data + 12345, 1000) == 0  # inside a buffer
    assert client.get_into("zc-np", dst.ctypes.data, dst.nbytes) == MiB
    assert np.array_equal(dst[:MiB], src[:MiB])
    assert client.get_into("zc-np-off", dst.ctypes.data + 5, 1000) == 1000
    assert bytes(dst[5:1005]) == bytes(src[12345:13345])
    assert holder.get("zc-np-off") == bytes(src[12345:13345])
    keys = [f"zc-np-b{i}" for i in range(4)]
    ptrs = [src.ctypes.data + i * 300_000 for i in range(4)]
    sizes = [100_000 * (i + 1) for i in range(4)]
    assert client.batch_put_from(keys, ptrs, sizes) == [0, 0, 0, 0]
    dst[:] = 0
    out = [dst.ctypes.data + i * 500_000 for i in range(4)]
    assert client.batch_get_into([*keys, "zc-missing"], [*out, out[0]], [500_000] * 5) == [
        *sizes,
        NOT_FOUND,
    ]
    for i in range(4):
        got = dst[i * 500_000 : i * 500_000 + sizes[i]]
        assert np.array_equal(got, src[i * 300_000 : i * 300_000 + sizes[i]])
    assert client.get_into("zc-np", dst.ctypes.data, 1000) == INVALID  # too small: as Mooncake
    assert client.unregister_buffer(src.ctypes.data) == 0
    assert client.unregister_buffer(dst.ctypes.data) == 0


def test_zero_copy_torch_data_ptr(pool):
    _, client = pool
    torch.manual_seed(0)
    src = torch.randn(64, 1024, dtype=torch.float16)
    dst = torch.zeros_like(src)
    nbytes = src.numel() * src.element_size()
    assert client.register_buffer(src.data_ptr(), nbytes) == 0
    assert client.register_buffer(dst.data_ptr(), nbytes) == 0
    assert client.put_from("zc-torch", src.data_ptr(), nbytes) == 0
    assert client.get_into("zc-torch", dst.data_ptr(), nbytes) == nbytes
    assert torch.equal(src, dst)
    half, rows = nbytes // 2, src[32:].data_ptr()
    assert client.batch_put_from(["zc-t0", "zc-t1"], [src.data_ptr(), rows], [half, half]) == [0, 0]
    dst.zero_()
    out = [dst.data_ptr(), dst[32:].data_ptr()]
    assert client.batch_get_into(["zc-t1", "zc-t0"], out, [half, half]) == [half, half]
    assert torch.equal(dst[:32], src[32:]) and torch.equal(dst[32:], src[:32])
    assert client.unregister_buffer(src.data_ptr()) == 0
    assert client.unregister_buffer(dst) == 0  # the object resolves to its address


def test_pointers_outside_registered_memory_are_refused(pool):
    _, client = pool
    reg = np.arange(4096, dtype=np.uint8)
    other = np.full(4096, 7, dtype=np.uint8)
    assert client.register_buffer(reg.ctypes.data, reg.nbytes) == 0
    assert client.put("oob", bytes(4096)) == 0
    assert client.put_from("oob-a", other.ctypes.data, 100) == INVALID
    assert client.get_into("oob", other.ctypes.data, 4096) == INVALID
    assert (other == 7).all()  # never touched
    assert client.put_from("oob-b", reg.ctypes.data + 4000, 200) == INVALID  # runs past the end
    assert client.get_into("oob", reg.ctypes.data - 1, 4096) == INVALID
    assert client.batch_put_from(
        ["oob-c", "oob-d"], [other.ctypes.data, reg.ctypes.data], [10, 10]
    ) == [
        INVALID,
        0,
    ]
    assert client.batch_get_into(["oob-d"], [other.ctypes.data], [10]) == [INVALID]
    assert client.register_buffer(reg.ctypes.data + 10, 100) == INVALID  # overlaps
    assert client.register_buffer(0, 100) == INVALID
    assert client.unregister_buffer(reg.ctypes.data) == 0
    assert client.unregister_buffer(reg.ctypes.data) == INVALID
    assert client.put_from("oob-e", reg.ctypes.data, 10) == INVALID
    ro = b"read-only bytes"
    assert client.register_buffer(ro) == 0  # a buffer object: readable, not writable
    assert client.put_from("oob-ro", ro, len(ro)) == 0 and client.get("oob-ro") == ro
    assert client.get_into("oob-ro", ro, len(ro)) == INVALID
    assert client.unregister_buffer(ro) == 0


def test_setup_failures_return_codes(master):
    store = MooncakeDistributedStore()
    store.setup_timeout = 0.5
    from support.ports import free_port

    t0 = time.monotonic()
    dead = f"127.0.0.1:{free_port()}"
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", dead) != 0
    assert time.monotonic() - t0 < 5
    assert store.setup("localhost", "redis://x:1", 0, 0, "tcp", "", master) != 0
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", "no-port") != 0
    dead_dir = f"http://127.0.0.1:{free_port()}/metadata"
    assert store.setup("localhost", dead_dir, 0, 0, "tcp", "", master) != 0
    assert store.put("k", b"v") == NOT_READY and store.get("k") == b""
    assert store.close() == 0


def test_setup_twice_and_close_twice(master):
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 8 * MiB, 0, "tcp", "", master) == 0
    assert store.setup("localhost", "P2PHANDSHAKE", 8 * MiB, 0, "tcp", "", master) == NOT_READY
    assert store.put("twice", b"still works") == 0 and store.get("twice") == b"still works"
    host, port = store.get_hostname().rsplit(":", 1)
    assert host == "localhost" and port.isdigit()  # host:port, as Mooncake's
    assert store.close() == 0
    assert store.close() == 0
    assert store.put("twice-2", b"x") == NOT_READY and store.is_exist("twice") == -1
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0  # again
    assert store.close() == 0


def test_unsupported_methods_are_explicit():
    from kvpool.integrations.mooncake import UNSUPPORTED

    store = MooncakeDistributedStore()
    for name in [*UNSUPPORTED, "get_tensor_with_tp", "batch_pub_tensor", "get_tensor_into_cuda"]:
        assert not hasattr(store, name), name
        with pytest.raises(NotImplementedError, match=name):
            getattr(store, name)
    assert hasattr(store, "upsert") and hasattr(store, "get_tensor")  # provided now
    with pytest.raises(AttributeError):
        store.no_such_method  # noqa: B018


def test_directory_url_mapping():
    assert directory_url("P2PHANDSHAKE") is None  # the master's own directory
    assert directory_url("http://10.0.0.1:8080/metadata") == "http://10.0.0.1:8080"
    assert directory_url("http://h:8080/") == "http://h:8080"
    assert directory_url("etcd://h:2379") == "etcd://h:2379"
    assert directory_url("127.0.0.1:2379,h2:2379") == "etcd://127.0.0.1:2379,h2:2379"
    with pytest.raises(ValueError):
        directory_url("redis://h:6379")


HOLDER = """
import sys
import numpy as np
from kvpool.integrations.mooncake import MooncakeDistributedStore
directory, master, protocol = sys.argv[1:4]
store = MooncakeDistributedStore()
rc = store.setup("localhost", directory, 32 << 20, 0, protocol, "", master)
if rc != 0:
    print("FAILED", rc, flush=True)
    sys.exit(1)
for i in range(4):
    assert store.put(f"mp-{i}", np.random.default_rng(i).bytes(1000 + i * 300_000)) == 0
print("READY", flush=True)
sys.stdin.read()
print("CLOSED", store.close(), flush=True)
"""


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_holder_in_another_process(protocol):
    service = MasterService()
    server = service.serve()
    meta = MetadataServer()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-c", HOLDER, meta.url + "/metadata", server.address, protocol]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    client = MooncakeDistributedStore()
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().strip() == "READY"
        assert client.setup("localhost", meta.url, 0, 0, protocol, "", server.address) == 0
        for i in range(4):
            expected = np.random.default_rng(i).bytes(1000 + i * 300_000)
            assert client.get(f"mp-{i}") == expected
        value = payload(3 * MiB, 9)  # lands in the other process's segment
        assert client.put("mp-from-client", value) == 0
        assert client.get("mp-from-client") == value
        assert RpcClient(server.address).call("stats")["nodes"] == 1
        out, _ = proc.communicate(input="", timeout=30)
        assert proc.returncode == 0 and "CLOSED 0" in out
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        server.close()
        service.close()
        meta.close()


def test_earlier_import_path_still_works():
    from kvpool.store.mooncake_compat import MooncakeDistributedStore as Earlier

    assert Earlier is MooncakeDistributedStore

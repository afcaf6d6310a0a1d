"""Sequences of Mooncake Store calls, run unchanged against the real ``mooncake.store`` and
against ``kvpool.integrations.mooncake`` (the differential suite, ``test_mooncake_diff.py``).

This file imports neither kvpool nor anything the Mooncake wheel's virtualenv lacks (torch
is optional: the tensor scenario needs it). It runs as a script in either environment::

    python mooncake_scenarios.py kvpool|mooncake < '{"master_cmd": [...], "scenarios": [...]}'

For each scenario it starts a fresh master from ``master_cmd`` (``{port}`` replaced by a free
port), runs the scenario's calls, stops the master, and prints one JSON object: per scenario
the list of ``[label, method, result]`` (results normalized: bytes by length and digest,
tensors by dtype, shape and digest, replicas by status, tier and size; never addresses).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import random
import re
import socket
import subprocess
import sys
import time

LEASE_S = 1.0  # both masters run with this read lease
MiB = 1 << 20


def digest(data) -> list:
    raw = bytes(memoryview(data))
    return ["bytes", len(raw), hashlib.blake2b(raw, digest_size=8).hexdigest()]


def normalize(value):
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(getattr(value, "ptr", None)) and callable(getattr(value, "size", None)):
        size = value.size()  # a BufferHandle
        return ["buffer", size, digest(ctypes.string_at(value.ptr(), size) if size else b"")[2]]
    if isinstance(value, bytes | bytearray | memoryview):
        return digest(value)
    if type(value).__name__ == "Tensor":
        raw = value.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
        return ["tensor", str(value.dtype), list(value.shape), digest(raw)[2]]
    if hasattr(value, "is_memory_replica"):
        status = getattr(value.status, "name", str(value.status).rsplit(".", 1)[-1])
        size = value.get_memory_descriptor().buffer_descriptor.size
        return ["replica", status, value.is_memory_replica(), size]
    if isinstance(value, dict):
        return {str(k): normalize(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [normalize(v) for v in value]
    return ["object", type(value).__name__]


class Ctx:
    """What a scenario uses: stores on the master, values, registered buffers, a record."""

    def __init__(self, api, master: str) -> None:
        self.api, self.master = api, master
        self.records: list = []
        self.stores: list = []
        self.keep: list = []  # ctypes buffers, alive until the scenario ends

    def store(self, segment: int = 64 * MiB):
        s = self.api.MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * MiB, "tcp", "", self.master)
        if rc != 0:
            raise RuntimeError(f"setup failed: {rc}")
        self.stores.append(s)
        return s

    def config(self, **fields):
        c = self.api.ReplicateConfig()
        for k, v in fields.items():
            setattr(c, k, getattr(self.api.SoftPinAction, v) if k == "soft_pin_action" else v)
        return c

    @staticmethod
    def val(n: int, seed: int = 0) -> bytes:
        return random.Random(seed * 1_000_003 + n).randbytes(n)

    def buf(self, n: int, data: bytes = b""):
        """A ctypes buffer of ``n`` bytes (starting with ``data``) and its address."""
        b = ctypes.create_string_buffer(n)
        ctypes.memmove(b, data, len(data))
        self.keep.append(b)
        return b, ctypes.addressof(b)

    def rec(self, label: str, method: str, fn) -> object:
        try:
            out = fn()
        except Exception as exc:  # recorded, not raised: both sides must agree on it
            self.records.append([label, method, ["raises", type(exc).__name__]])
            return None
        self.records.append([label, method, normalize(out)])
        return out

    def close(self) -> None:
        for s in self.stores:
            s.close()


# -- the scenarios ------------------------------------------------------------------------------


def basics(c: Ctx) -> None:
    s = c.store()
    a, b = c.val(1000, 1), c.val(70_000, 2)
    c.rec("put", "put", lambda: s.put("k/a", a))
    c.rec("get", "get", lambda: s.get("k/a"))
    c.rec("size", "get_size", lambda: s.get_size("k/a"))
    c.rec("exist", "is_exist", lambda: s.is_exist("k/a"))
    c.rec("put again keeps first", "put", lambda: s.put("k/a", b))
    c.rec("get first", "get", lambda: s.get("k/a"))
    c.rec("missing get", "get", lambda: s.get("k/none"))
    c.rec("missing size", "get_size", lambda: s.get_size("k/none"))
    c.rec("missing exist", "is_exist", lambda: s.is_exist("k/none"))
    c.rec("missing remove", "remove", lambda: s.remove("k/none"))
    c.rec("put empty", "put", lambda: s.put("k/empty", b""))
    c.rec("empty key", "put", lambda: s.put("", b"x"))
    c.rec("put_batch", "put_batch", lambda: s.put_batch(["k/b0", "k/b1", "k/b2"], [a, b, a[:10]]))
    c.rec("get_batch", "get_batch", lambda: s.get_batch(["k/b0", "k/none", "k/b2"]))
    c.rec("batch_is_exist", "batch_is_exist", lambda: s.batch_is_exist(["k/b1", "k/none"]))
    c.rec("put_parts", "put_parts", lambda: s.put_parts("k/parts", b"ab", bytearray(b"cd"), b"e"))
    c.rec("get parts", "get", lambda: s.get("k/parts"))
    c.rec("remove unread", "remove", lambda: s.remove("k/b1"))
    c.rec("gone", "is_exist", lambda: s.is_exist("k/b1"))
    c.rec("batch_remove", "batch_remove", lambda: s.batch_remove(["k/none", "k/parts"]))
    c.rec("put_batch ragged", "put_batch", lambda: s.put_batch(["k/x1", "k/x2"], [a]))
    c.rec("ragged left nothing", "batch_is_exist", lambda: s.batch_is_exist(["k/x1", "k/x2"]))
    c.rec("large", "put", lambda: s.put("k/large", c.val(5 * MiB, 3)))
    c.rec("get large", "get", lambda: s.get("k/large"))


def leases(c: Ctx) -> None:
    s, other = c.store(), c.store(0)
    c.rec("put", "put", lambda: s.put("l/a", b"leased value"))
    c.rec("read by another client", "get", lambda: other.get("l/a"))
    c.rec("remove while leased", "remove", lambda: s.remove("l/a"))
    c.rec("is_exist while leased", "is_exist", lambda: s.is_exist("l/a"))
    time.sleep(LEASE_S * 1.6)
    c.rec("remove after lease", "remove", lambda: s.remove("l/a"))
    c.rec("put", "put", lambda: s.put("l/b", b"v"))
    c.rec("read", "get", lambda: s.get("l/b"))
    c.rec("forced remove while leased", "remove", lambda: s.remove("l/b", True))
    c.rec("gone", "get", lambda: other.get("l/b"))
    c.rec("put", "put", lambda: s.put("l/c", b"old"))
    c.rec("read", "get", lambda: other.get("l/c"))
    c.rec("upsert while leased", "upsert", lambda: s.upsert("l/c", b"new value"))
    c.rec("new value", "get", lambda: other.get("l/c"))
    c.rec("batch_remove leased", "batch_remove", lambda: s.batch_remove(["l/c"]))
    lookups = {
        "is_exist": lambda k: s.is_exist(k),
        "batch_is_exist": lambda k: s.batch_is_exist([k]),
        "get_size": lambda k: s.get_size(k),
        "get_replica_desc": lambda k: len(s.get_replica_desc(k)),
        "batch_get_replica_desc": lambda k: len(s.batch_get_replica_desc([k])),
        "get_buffer": lambda k: s.get_buffer(k),
    }
    for method, look in lookups.items():
        key = f"l/look-{method}"
        c.rec(f"put for {method}", "put", lambda key=key: s.put(key, b"x" * 100))
        c.rec(f"{method}", method, lambda key=key, look=look: look(key))
        c.rec(f"remove after {method} (leased?)", "remove", lambda key=key: s.remove(key))


def upserts(c: Ctx) -> None:
    s = c.store()
    c.rec("upsert new", "upsert", lambda: s.upsert("u/a", b"first"))
    c.rec("get", "get", lambda: s.get("u/a"))
    c.rec("upsert unread", "upsert", lambda: s.upsert("u/a", c.val(3000, 1)))
    c.rec("get", "get", lambda: s.get("u/a"))
    c.rec("size", "get_size", lambda: s.get_size("u/a"))
    c.rec("upsert_batch", "upsert_batch", lambda: s.upsert_batch(["u/a", "u/b"], [b"A2", b"B2"]))
    c.rec("get_batch", "get_batch", lambda: s.get_batch(["u/a", "u/b"]))
    c.rec("upsert_parts", "upsert_parts", lambda: s.upsert_parts("u/b", b"x", b"yz"))
    c.rec("get", "get", lambda: s.get("u/b"))
    _, addr = c.buf(MiB, c.val(MiB, 2))
    c.rec("register", "register_buffer", lambda: s.register_buffer(addr, MiB))
    c.rec("upsert_from", "upsert_from", lambda: s.upsert_from("u/a", addr, 4096))
    c.rec("get", "get", lambda: s.get("u/a"))
    c.rec("batch_upsert_from", "batch_upsert_from",
          lambda: s.batch_upsert_from(["u/a", "u/c"], [addr, addr + 100], [10, 2000]))  # fmt: skip
    c.rec("get_batch", "get_batch", lambda: s.get_batch(["u/a", "u/c"]))
    c.rec("unregister", "unregister_buffer", lambda: s.unregister_buffer(addr))


def buffers(c: Ctx) -> None:
    s = c.store()
    value = c.val(200_000, 4)
    c.rec("put", "put", lambda: s.put("b/a", value))
    c.rec("get_buffer", "get_buffer", lambda: s.get_buffer("b/a"))
    c.rec("get_buffer missing", "get_buffer", lambda: s.get_buffer("b/none"))
    c.rec("batch_get_buffer", "batch_get_buffer",
          lambda: s.batch_get_buffer(["b/a", "b/none", "b/a"]))  # fmt: skip
    c.rec("put small", "put", lambda: s.put("b/small", b"tiny"))
    c.rec("get_buffer small", "get_buffer", lambda: s.get_buffer("b/small"))


def zero_copy(c: Ctx) -> None:
    s = c.store()
    _, sa = c.buf(2 * MiB, c.val(2 * MiB, 5))
    dst, da = c.buf(2 * MiB)
    _, ua = c.buf(4096)
    c.rec("register src", "register_buffer", lambda: s.register_buffer(sa, 2 * MiB))
    c.rec("register dst", "register_buffer", lambda: s.register_buffer(da, 2 * MiB))
    c.rec("put_from", "put_from", lambda: s.put_from("z/a", sa, MiB))
    c.rec("put_from inside", "put_from", lambda: s.put_from("z/b", sa + 12345, 1000))
    c.rec("put_from zero", "put_from", lambda: s.put_from("z/zero", sa, 0))
    c.rec("get_into", "get_into", lambda: s.get_into("z/a", da, 2 * MiB))
    c.rec("bytes read", "get_into", lambda: dst.raw[:MiB])
    c.rec("get_into exact", "get_into", lambda: s.get_into("z/b", da + 5, 1000))
    c.rec("bytes read", "get_into", lambda: dst.raw[5:1005])
    c.rec("get_into too small", "get_into", lambda: s.get_into("z/a", da, 1000))
    c.rec("get_into missing", "get_into", lambda: s.get_into("z/none", da, 1000))
    keys = [f"z/batch{i}" for i in range(4)]
    ptrs, sizes = [sa + i * 300_000 for i in range(4)], [100_000 * (i + 1) for i in range(4)]
    c.rec("batch_put_from", "batch_put_from", lambda: s.batch_put_from(keys, ptrs, sizes))
    outs = [da + i * 500_000 for i in range(4)]
    c.rec("batch_get_into", "batch_get_into",
          lambda: s.batch_get_into([*keys, "z/none"], [*outs, outs[0]], [500_000] * 5))  # fmt: skip
    c.rec("bytes read", "batch_get_into", lambda: dst.raw[500_000:700_000])
    c.rec("batch_put_from ragged", "batch_put_from",
          lambda: s.batch_put_from(["z/r1", "z/r2"], [sa], [10]))  # fmt: skip
    c.rec("multi put", "batch_put_from_multi_buffers",
          lambda: s.batch_put_from_multi_buffers(["z/mb"], [[sa, sa + 100]], [[10, 20]]))  # fmt: skip
    c.rec("multi value", "get", lambda: s.get("z/mb"))
    c.rec("multi get", "batch_get_into_multi_buffers",
          lambda: s.batch_get_into_multi_buffers(["z/mb"], [[da, da + 100]], [[15, 15]]))  # fmt: skip
    c.rec("multi bytes", "batch_get_into_multi_buffers", lambda: dst.raw[:15] + dst.raw[100:115])
    c.rec("batch_put_from zero", "batch_put_from",
          lambda: s.batch_put_from(["z/z1", "z/z2"], [sa, sa], [0, 10]))  # fmt: skip
    c.rec("zero left nothing", "batch_is_exist", lambda: s.batch_is_exist(["z/zero", "z/z1"]))
    c.rec("put_from unregistered", "put_from", lambda: s.put_from("z/u", ua, 100))
    c.rec("unregister", "unregister_buffer", lambda: s.unregister_buffer(sa))
    c.rec("unregister dst", "unregister_buffer", lambda: s.unregister_buffer(da))


def ranges(c: Ctx) -> None:
    s = c.store()
    a, b = c.val(100_000, 6), c.val(50_000, 7)
    c.rec("put_batch", "put_batch", lambda: s.put_batch(["r/a", "r/b"], [a, b]))
    dst, da = c.buf(64 * 1024)
    c.rec("register", "register_buffer", lambda: s.register_buffer(da, 64 * 1024))
    c.rec("ranges", "get_into_ranges", lambda: s.get_into_ranges(
        [da], [["r/a", "r/b"]], [[[0, 1000], [5000]]], [[[99_000, 0], [49_990]]],
        [[[1000, 500], [10]]]))  # fmt: skip
    c.rec("bytes", "get_into_ranges", lambda: dst.raw[:1500] + dst.raw[5000:5010])
    c.rec("two buffers", "get_into_ranges", lambda: s.get_into_ranges(
        [da + 20_000, da + 40_000], [["r/b"], ["r/a"]], [[[0]], [[0, 100]]], [[[1]], [[2, 3]]],
        [[[4]], [[5, 6]]]))  # fmt: skip
    c.rec("bytes", "get_into_ranges",
          lambda: dst.raw[20_000:20_004] + dst.raw[40_000:40_005] + dst.raw[40_100:40_106])  # fmt: skip
    c.rec("missing key", "get_into_ranges",
          lambda: s.get_into_ranges([da], [["r/none"]], [[[0]]], [[[0]]], [[[8]]]))  # fmt: skip
    c.rec("past the value's end", "get_into_ranges",
          lambda: s.get_into_ranges([da], [["r/b"]], [[[0]]], [[[49_998]]], [[[8]]]))  # fmt: skip
    c.rec("ragged", "get_into_ranges",
          lambda: s.get_into_ranges([da], [["r/b"]], [[[0, 8]]], [[[0]]], [[[4, 4]]]))  # fmt: skip


def tensors(c: Ctx) -> None:
    import torch

    s = c.store()

    def values(shape: tuple, seed: int, signed: bool = True):
        """The same on every CPU: no vectorized randn, no negative float to unsigned."""
        n = 1
        for d in shape:
            n *= d
        raw = torch.frombuffer(bytearray(c.val(n, seed)), dtype=torch.uint8)
        return (raw.to(torch.float32) / 8 - (16 if signed else 0)).reshape(shape)

    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.uint16,
              torch.float8_e4m3fn]  # fmt: skip
    for i, dt in enumerate(dtypes):
        unsigned = dt in (torch.uint8, torch.uint16, torch.bool)
        t = values((3, 5, 7), i, signed=not unsigned).to(dt)
        c.rec(f"put {dt}", "put_tensor", lambda t=t, dt=dt: s.put_tensor(f"t/{dt}", t))
        c.rec(f"get {dt}", "get_tensor", lambda dt=dt: s.get_tensor(f"t/{dt}"))
        c.rec(f"raw {dt}", "get", lambda dt=dt: s.get(f"t/{dt}"))  # the same value layout
    strided = torch.arange(60, dtype=torch.float32).reshape(6, 10)[:, ::2]
    c.rec("strided", "put_tensor", lambda: s.put_tensor("t/strided", strided))
    c.rec("strided back", "get_tensor", lambda: s.get_tensor("t/strided"))
    c.rec("empty", "put_tensor", lambda: s.put_tensor("t/empty", torch.zeros(0, 4)))
    c.rec("empty back", "get_tensor", lambda: s.get_tensor("t/empty"))
    c.rec("scalar", "put_tensor", lambda: s.put_tensor("t/scalar", torch.tensor(3.5)))
    c.rec("scalar back", "get_tensor", lambda: s.get_tensor("t/scalar"))
    c.rec("scalar value", "get", lambda: s.get("t/scalar"))
    c.rec("put existing", "put_tensor", lambda: s.put_tensor("t/strided", torch.ones(2)))
    c.rec("first kept", "get_tensor", lambda: s.get_tensor("t/strided"))
    c.rec("upsert", "upsert_tensor", lambda: s.upsert_tensor("t/strided", torch.ones(2)))
    c.rec("upserted", "get_tensor", lambda: s.get_tensor("t/strided"))
    c.rec("batch upsert", "batch_upsert_tensor",
          lambda: s.batch_upsert_tensor(["t/strided", "t/new"], [torch.zeros(3), torch.ones(1)]))  # fmt: skip
    c.rec("not a tensor", "put_tensor", lambda: s.put_tensor("t/bad", "x"))
    c.rec("9 dims", "put_tensor", lambda: s.put_tensor("t/bad", torch.zeros(*[1] * 9)))
    c.rec(
        "complex",
        "put_tensor",
        lambda: s.put_tensor("t/bad", torch.zeros(2, dtype=torch.complex64)),
    )
    c.rec("put raw", "put", lambda: s.put("t/raw", b"raw bytes, no header"))
    c.rec("raw as tensor", "get_tensor", lambda: s.get_tensor("t/raw"))
    c.rec("missing", "get_tensor", lambda: s.get_tensor("t/none"))
    c.rec("batch put", "batch_put_tensor",
          lambda: s.batch_put_tensor(["t/b1", "t/b2"], [torch.ones(2), torch.zeros(3, 2)]))  # fmt: skip
    c.rec("batch get", "batch_get_tensor", lambda: s.batch_get_tensor(["t/b1", "t/none", "t/b2"]))
    c.rec(
        "batch ragged", "batch_put_tensor", lambda: s.batch_put_tensor(["a", "b"], [torch.ones(1)])
    )
    buf, addr = c.buf(1 << 16)
    c.rec("register", "register_buffer", lambda: s.register_buffer(addr, 1 << 16))
    src = values((16, 32), 99).to(torch.float16)
    c.rec("put", "put_tensor", lambda: s.put_tensor("t/zc", src))
    c.rec("get_tensor_into", "get_tensor_into", lambda: s.get_tensor_into("t/zc", addr, 1 << 16))
    c.rec("buffer holds the value", "get_tensor_into", lambda: buf.raw[: s.get_size("t/zc")])
    n = s.get_size("t/zc")
    c.rec("put_tensor_from", "put_tensor_from", lambda: s.put_tensor_from("t/zc2", addr, n))
    c.rec("round trip", "get_tensor", lambda: s.get_tensor("t/zc2"))
    c.rec(
        "put_tensor_from short", "put_tensor_from", lambda: s.put_tensor_from("t/zc3", addr, n - 1)
    )
    c.rec("get_tensor_into small", "get_tensor_into", lambda: s.get_tensor_into("t/zc", addr, 100))
    c.rec("get_tensor_into missing", "get_tensor_into",
          lambda: s.get_tensor_into("t/none", addr, 4096))  # fmt: skip
    c.rec("batch_get_tensor_into", "batch_get_tensor_into",
          lambda: s.batch_get_tensor_into(["t/zc", "t/none"], [addr, addr + 8192], [8192, 8192]))  # fmt: skip
    c.rec("batch_put_tensor_from", "batch_put_tensor_from",
          lambda: s.batch_put_tensor_from(["t/zc4", "t/zc5"], [addr, addr], [n, n]))  # fmt: skip
    c.rec("batch_put_tensor_from one bad", "batch_put_tensor_from",
          lambda: s.batch_put_tensor_from(["t/zc6", "t/zc7"], [addr, addr], [n, 10]))  # fmt: skip
    c.rec("all or nothing", "batch_is_exist", lambda: s.batch_is_exist(["t/zc5", "t/zc6"]))


def replicas(c: Ctx) -> None:
    s = c.store()
    name = s.get_hostname()
    c.rec("hostname is host:port", "get_hostname",
          lambda: re.fullmatch(r"127\.0\.0\.1:\d+", name) is not None)  # fmt: skip
    c.rec("put", "put", lambda: s.put("p/a", c.val(5000, 8)))
    c.rec("desc", "get_replica_desc", lambda: s.get_replica_desc("p/a"))
    c.rec("endpoint is host:port", "get_replica_desc", lambda: [re.fullmatch(
        r"127\.0\.0\.1:\d+", d.get_memory_descriptor().buffer_descriptor.transport_endpoint)
        is not None for d in s.get_replica_desc("p/a")])  # fmt: skip
    c.rec("desc missing", "get_replica_desc", lambda: s.get_replica_desc("p/none"))
    c.rec("batch desc", "batch_get_replica_desc",
          lambda: s.batch_get_replica_desc(["p/a", "p/none"]))  # fmt: skip
    c.rec("two replicas, one node", "put", lambda: s.put("p/two", b"2", c.config(replica_num=2)))
    c.rec("how many", "get_replica_desc", lambda: s.get_replica_desc("p/two"))
    c.rec("preferred own", "put", lambda: s.put("p/pref", b"p", c.config(preferred_segment=name)))
    c.rec("preferred missing", "put", lambda: s.put("p/pm", b"m", c.config(
        preferred_segment="nowhere:1")))  # fmt: skip
    c.rec("placed elsewhere", "get", lambda: s.get("p/pm"))
    c.rec("preferred list", "put", lambda: s.put("p/pl", b"l", c.config(preferred_segments=[name])))
    c.rec("zero replicas", "put", lambda: s.put("p/r0", b"0", c.config(replica_num=0)))
    c.rec("hard pin", "put", lambda: s.put("p/hard", b"h", c.config(with_hard_pin=True)))
    c.rec("soft pin", "put", lambda: s.put("p/soft", b"s", c.config(soft_pin_action="ENABLE")))
    c.rec(
        "soft pin old spelling", "put", lambda: s.put("p/soft2", b"s", c.config(with_soft_pin=True))
    )
    c.rec("soft pin ttl", "put", lambda: s.put("p/soft3", b"s", c.config(
        soft_pin_action="ENABLE", soft_pin_ttl_ms=60_000)))  # fmt: skip
    c.rec(
        "same node", "put", lambda: s.put("p/same", b"n", c.config(prefer_alloc_in_same_node=True))
    )
    c.rec("all readable", "get_batch",
          lambda: s.get_batch(["p/hard", "p/soft", "p/soft2", "p/soft3", "p/same"]))  # fmt: skip
    c.rec("remove hard-pinned", "remove", lambda: s.remove("p/hard"))


def bulk_removal(c: Ctx) -> None:
    s = c.store()
    keys = [f"layer-{i}/block-{j}" for i in range(3) for j in range(4)]
    c.rec("put_batch", "put_batch", lambda: s.put_batch([*keys, "other"], [b"v"] * 13))
    c.rec("bad regex", "remove_by_regex", lambda: s.remove_by_regex("(["))
    c.rec("by regex", "remove_by_regex", lambda: s.remove_by_regex("^layer-1/"))
    c.rec(
        "left", "batch_is_exist", lambda: s.batch_is_exist(["layer-1/block-0", "layer-0/block-0"])
    )
    c.rec("read one", "get", lambda: s.get("layer-2/block-3"))
    c.rec("leased stays", "remove_by_regex", lambda: s.remove_by_regex("layer-2"))
    c.rec("still there", "is_exist", lambda: s.is_exist("layer-2/block-3"))
    c.rec("forced", "remove_by_regex", lambda: s.remove_by_regex("block-3$", True))
    c.rec("read other", "get", lambda: s.get("other"))
    c.rec("remove_all", "remove_all", lambda: s.remove_all())
    c.rec("remove_all forced", "remove_all", lambda: s.remove_all(True))
    c.rec("remove_all empty", "remove_all", lambda: s.remove_all())
    c.rec("nothing", "get", lambda: s.get("other"))


def lifecycle(c: Ctx) -> None:
    s = c.api.MooncakeDistributedStore()
    c.rec("health before setup", "health_check", lambda: s.health_check())
    config = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
              "global_segment_size": "16 MB", "local_buffer_size": "16 MB", "protocol": "tcp",
              "master_server_addr": c.master}  # fmt: skip
    c.rec("setup dict", "setup", lambda: s.setup(config))
    c.rec("health", "health_check", lambda: s.health_check())
    c.rec("put", "put", lambda: s.put("life/a", b"v"))
    c.rec("get", "get", lambda: s.get("life/a"))
    c.rec("close", "close", lambda: s.close())
    c.rec("health after close", "health_check", lambda: s.health_check())
    c.rec("setup again", "setup", lambda: s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB,
                                                  "tcp", "", c.master))  # fmt: skip
    c.rec("a closed node's objects are gone", "get", lambda: s.get("life/a"))
    c.rec("put after rejoin", "put", lambda: s.put("life/a", b"w"))
    c.rec("get after rejoin", "get", lambda: s.get("life/a"))
    c.rec("close", "close", lambda: s.close())
    cfg = c.api.ReplicateConfig()
    c.rec("config fields", "ReplicateConfig", lambda: [hasattr(cfg, a) for a in CONFIG_FIELDS])
    c.rec("config defaults", "ReplicateConfig", lambda: [
        cfg.replica_num, cfg.soft_pin_action.name, cfg.soft_pin_ttl_ms, cfg.with_hard_pin,
        cfg.preferred_segment, list(cfg.preferred_segments), cfg.prefer_alloc_in_same_node])  # fmt: skip


CONFIG_FIELDS = ("data_type", "dfs_replica_num", "group_ids", "nof_replica_num",
                 "prefer_alloc_in_same_node", "preferred_nof_segments", "preferred_segment",
                 "preferred_segments", "replica_num", "soft_pin_action", "soft_pin_ttl_ms",
                 "with_hard_pin")  # fmt: skip
SCENARIOS = {f.__name__: f for f in (basics, leases, upserts, buffers, zero_copy, ranges,
                                     tensors, replicas, bulk_removal, lifecycle)}  # fmt: skip


# -- running ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_master(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    argv = [a.replace("{port}", str(port)).replace("{port2}", str(_free_port())) for a in cmd]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"master exited with {proc.returncode}: {argv}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("master did not listen within 30 s")


def run(api, master_cmd: list[str], names: list[str]) -> dict:
    out = {}
    for name in names:
        proc, master = _start_master(master_cmd)
        ctx = Ctx(api, master)
        try:
            SCENARIOS[name](ctx)
        finally:
            ctx.close()
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        out[name] = ctx.records
        print(f"scenario {name}: {len(ctx.records)} calls", file=sys.stderr, flush=True)
    return out


def main() -> None:
    impl = sys.argv[1]
    job = json.loads(sys.stdin.read())
    if impl == "mooncake":
        import mooncake.store as api
    else:
        import kvpool.integrations.mooncake as api
    results = run(api, job["master_cmd"], job["scenarios"])
    sys.stdout.write(json.dumps(results) + "\n")
    sys.stdout.flush()
    import os

    os._exit(0)  # Mooncake's threads may hang interpreter exit


if __name__ == "__main__":
    main()

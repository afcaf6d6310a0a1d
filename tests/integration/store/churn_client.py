"""A ``MooncakeDistributedStore`` in its own process, driven by JSON lines on stdin (one reply
line per command on stdout), for ``test_property_churn.py``.

Commands: ``setup {segment}``, ``close``, ``put {key, n, seed, upsert}``, ``put_from {key, n,
seed}``, ``put_batch {keys, ns, seeds}``, ``get {key}``, ``get_into {key}``, ``get_batch
{keys}``, ``remove {key}``, ``holders {key}``. Values are ``random.Random(seed).randbytes(n)``;
reads answer a digest (None for ``b""``)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import random
import sys

from kvpool.integrations.mooncake import MooncakeDistributedStore

BUF = 2 << 20  # the registered buffer of put_from / get_into


def value(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def digest(data: bytes) -> str | None:
    return hashlib.blake2b(data, digest_size=8).hexdigest() if data else None


class Client:
    def __init__(self, master: str) -> None:
        self.master = master
        self.store = MooncakeDistributedStore()
        self.buf = ctypes.create_string_buffer(BUF)
        self.addr = ctypes.addressof(self.buf)

    def setup(self, segment: int) -> int:
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 0, "tcp", "", self.master)
        if rc == 0:
            rc = self.store.register_buffer(self.addr, BUF)
        return rc

    def run(self, cmd: dict):
        op, s = cmd["op"], self.store
        if op == "setup":
            return self.setup(cmd["segment"])
        if op == "close":
            return s.close()
        if op == "hostname":
            return s.get_hostname()
        if op == "put":
            method = s.upsert if cmd.get("upsert") else s.put
            return method(cmd["key"], value(cmd["n"], cmd["seed"]))
        if op == "put_from":
            data = value(cmd["n"], cmd["seed"])
            ctypes.memmove(self.addr, data, len(data))
            return s.put_from(cmd["key"], self.addr, len(data))
        if op == "put_batch":
            vals = [value(n, seed) for n, seed in zip(cmd["ns"], cmd["seeds"], strict=True)]
            return s.put_batch(cmd["keys"], vals)
        if op == "get":
            return digest(s.get(cmd["key"]))
        if op == "get_into":
            n = s.get_into(cmd["key"], self.addr, BUF)
            return digest(self.buf.raw[:n]) if n > 0 else n
        if op == "get_batch":
            return [digest(v) for v in s.get_batch(cmd["keys"])]
        if op == "remove":
            return s.remove(cmd["key"])
        if op == "holders":
            descs = s.get_replica_desc(cmd["key"])
            return [d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in descs]
        raise ValueError(f"unknown op {op!r}")


def main() -> None:
    client = Client(sys.argv[1])
    rc = client.setup(int(sys.argv[2]))
    print(json.dumps({"ready": rc, "hostname": client.store.get_hostname()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = {"ok": client.run(cmd)}
        except Exception as exc:  # reported: the driver fails the test with it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    client.store.close()


if __name__ == "__main__":
    main()

"""Mooncake Store's holder and client driver for ``bench_store.py``; run by the mooncake venv's
python (started by ``mooncake_store_peer.py``, environment from ``mooncake_transfer_peer``:
``MC_FORCE_TCP=true`` and the unpacked libibverbs). Never imports kvpool.

    python mooncake_store_inner.py holder '{"master": "127.0.0.1:P", "segment_bytes": N,
                                           "warm_bytes": M}'
    python mooncake_store_inner.py client '{"master": ..., "sizes": [...], "seconds": ..., ...}'

The holder mounts a global segment of ``segment_bytes`` (the pool's memory), touches it by
putting and removing ``warm_bytes`` of 8 MiB values (Mooncake allocates the segment's pages
lazily), prints one JSON line and serves until its stdin closes. The client mounts no segment
(``global_segment_size=0``: every value lives in the holder), registers its buffer and runs the
shared workload of ``bench_store.py`` with ``put_from`` / ``get_into`` (single) and
``batch_put_from`` / ``batch_get_into`` (batched, zero-copy), then prints one JSON line.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_store import alloc_buffer, run_workload

HOST = "127.0.0.1"
METADATA = "P2PHANDSHAKE"
LOCAL_BUFFER = 16 << 20  # Mooncake's own staging buffer (used by put/get of bytes only)
WARM_VALUE = 8 << 20


def _store(master: str, segment_bytes: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, METADATA, segment_bytes, LOCAL_BUFFER, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(
            f"setup({HOST!r}, {METADATA!r}, global_segment_size={segment_bytes}, "
            f"local_buffer_size={LOCAL_BUFFER}, 'tcp', '', {master!r}) = {rc}"
        )
    return store


def holder(cfg: dict) -> None:
    store = _store(cfg["master"], int(cfg["segment_bytes"]))
    block = bytes(WARM_VALUE)
    keys = [f"warm/{i}" for i in range(int(cfg.get("warm_bytes", 0)) // WARM_VALUE)]
    for k in keys:
        rc = store.put(k, block)
        if rc != 0:
            raise RuntimeError(f"warm-up put of {k} = {rc}")
    if keys:
        store.batch_remove(keys, True)
    print(json.dumps({"ready": True, "warmed": len(keys) * WARM_VALUE}), flush=True)
    sys.stdin.read()  # serve until the bench closes our stdin
    store.close()


class MooncakeStore:
    """The workload's adapter for ``MooncakeDistributedStore`` (one registered buffer)."""

    def __init__(self, master: str) -> None:
        self.store = _store(master, 0)
        self.addr = 0

    def alloc(self, nbytes: int) -> memoryview:
        self._mm, self.mv = alloc_buffer(nbytes)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        rc = self.store.register_buffer(self.addr, nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer({nbytes} bytes) = {rc}")
        return self.mv

    def put(self, key: str, off: int, size: int) -> None:
        rc = self.store.put_from(key, self.addr + off, size)
        if rc != 0:
            raise RuntimeError(f"put_from({key}) = {rc}")

    def get(self, key: str, off: int, size: int):
        n = self.store.get_into(key, self.addr + off, size)
        if n < 0:
            raise RuntimeError(f"get_into({key}) = {n}")
        return self.mv[off : off + n]

    def batch_put(self, keys: list[str], offs: list[int], size: int) -> None:
        rcs = self.store.batch_put_from(keys, [self.addr + o for o in offs], [size] * len(keys))
        bad = [(k, rc) for k, rc in zip(keys, rcs, strict=True) if rc != 0]
        if bad:
            raise RuntimeError(f"batch_put_from: {len(bad)} failed, first {bad[0]}")

    def batch_get(self, keys: list[str], offs: list[int], size: int) -> list:
        sizes = self.store.batch_get_into(keys, [self.addr + o for o in offs], [size] * len(keys))
        return [self.mv[o : o + n] if n >= 0 else None for o, n in zip(offs, sizes, strict=True)]

    def remove(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1024):
            self.store.batch_remove(keys[i : i + 1024], True)  # force: gets lease keys for 10 s

    def close(self) -> None:
        if self.addr:
            self.store.unregister_buffer(self.addr)
        self.store.close()


def client(cfg: dict) -> dict:
    store = MooncakeStore(cfg["master"])
    try:
        out = run_workload(store, cfg)
    finally:
        store.close()
    try:
        from importlib.metadata import version

        out["info"] = {"mooncake_version": version("mooncake-transfer-engine-non-cuda")}
    except Exception:  # metadata is a nicety
        pass
    return out


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if role == "holder":
        holder(cfg)
    else:
        print(json.dumps(client(cfg)), flush=True)


if __name__ == "__main__":
    main()

"""Measures Mooncake's TransferEngine over TCP on 127.0.0.1; run by the mooncake venv's python.

Started by ``mooncake_transfer_peer.py``; never imports kvpool. Two processes, two engines:
this script (the initiator) starts itself again as the target, which registers one buffer and
prints its session id and buffer address as a JSON line; the initiator registers a local buffer
of the same size and times ``transfer_sync_read`` / ``transfer_sync_write`` per size and
``batch_transfer_sync_read`` for a batch of 64 KiB pieces, then prints one JSON line of results.
Metadata goes through the engine's P2P handshake (``metadata_server="P2PHANDSHAKE"``); the
environment must set ``MC_FORCE_TCP=true``.

    python mooncake_transfer_inner.py '{"sizes": [65536], "batch": 64, "seconds": 1.0}'
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import select
import subprocess
import sys
import time

HOST = "127.0.0.1"
METADATA = "P2PHANDSHAKE"
PIECE = 64 * 1024
MAX_REPS = 20_000  # per size and op, besides the time budget
TARGET_START_TIMEOUT_S = 60.0


def _engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(HOST, METADATA, "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize({HOST!r}, {METADATA!r}, 'tcp', '') = {rc}")
    return engine


def _buffer(engine, size: int) -> tuple[mmap.mmap, int]:
    """Page-aligned anonymous buffer of ``size`` bytes, touched and registered with ``engine``."""
    buf = mmap.mmap(-1, size)
    buf.write(bytes(range(256)) * (size // 256))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    rc = engine.register_memory(addr, size)
    if rc != 0:
        raise RuntimeError(f"register_memory({size} bytes) = {rc}")
    return buf, addr


def target(size: int) -> None:
    engine = _engine()
    _buf, addr = _buffer(engine, size)
    session = f"{HOST}:{engine.get_rpc_port()}"
    print(json.dumps({"session": session, "addr": addr, "size": size}), flush=True)
    sys.stdin.read()  # serve until the initiator closes our stdin
    engine.unregister_memory(addr)


def _timed(fn, nbytes: int, seconds: float, min_reps: int = 3) -> float:
    """GB/s (1e9 bytes/s) of calling ``fn`` repeatedly for about ``seconds``."""
    fn()  # warm-up: connection set-up, first touch
    reps, start = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - start
        if reps >= MAX_REPS or (elapsed >= seconds and reps >= min_reps):
            break
    return nbytes * reps / elapsed / 1e9


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")


def initiator(cfg: dict) -> dict:
    import mooncake

    sizes = [int(s) for s in cfg["sizes"]]
    batch = int(cfg.get("batch", 64))
    seconds = float(cfg.get("seconds", 2.0))
    size = max([*sizes, batch * PIECE])
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--target", str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], TARGET_START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"target process gave no session (exit {proc.poll()})")
        peer = json.loads(line)
        session, remote = peer["session"], peer["addr"]

        engine = _engine()
        buf, local = _buffer(engine, size)
        out: dict = {"read_GBps": {}, "write_GBps": {}, "batch64x64KiB_GBps": None}

        for n in sizes:

            def read(n=n):
                _check(engine.transfer_sync_read(session, local, remote, n), "transfer_sync_read")

            def write(n=n):
                _check(engine.transfer_sync_write(session, local, remote, n), "transfer_sync_write")

            out["read_GBps"][n] = round(_timed(read, n, seconds), 4)
            out["write_GBps"][n] = round(_timed(write, n, seconds), 4)

        if hasattr(engine, "batch_transfer_sync_read") and batch > 0:
            offs = [i * PIECE for i in range(batch)]
            locs = [local + o for o in offs]
            rems = [remote + o for o in offs]
            lens = [PIECE] * batch

            def batch_read():
                rc = engine.batch_transfer_sync_read(session, locs, rems, lens)
                _check(rc, "batch_transfer_sync_read")

            out["batch64x64KiB_GBps"] = round(_timed(batch_read, batch * PIECE, seconds), 4)
            out["batch_pieces"] = batch

        # the target's buffer holds the pattern (ours, written over it); read it into zeros
        buf[:PIECE] = bytes(PIECE)
        _check(engine.transfer_sync_read(session, local, remote, PIECE), "transfer_sync_read")
        if buf[:PIECE] != bytes(range(256)) * (PIECE // 256):
            raise RuntimeError("data read back differs from the target's buffer")

        engine.unregister_memory(local)
        out["version"] = _version(mooncake)
        out["session"] = session
        return out
    finally:
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _version(mod) -> str:
    try:
        from importlib.metadata import version

        return version("mooncake-transfer-engine-non-cuda")
    except Exception:  # any metadata failure: fall back to the module
        return str(getattr(mod, "__version__", "unknown"))


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--target":
        target(int(sys.argv[2]))
        return
    cfg = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"sizes": [65536]}
    print(json.dumps(initiator(cfg)), flush=True)


if __name__ == "__main__":
    main()

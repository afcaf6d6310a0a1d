"""The transfer engine against real peer processes on 127.0.0.1 (shm and TCP paths)."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from kvpool.common.errors import BackpressureError, KVPoolTimeoutError, TransferError
from kvpool.entrypoints.transfer import pattern
from kvpool.transfer import Op, State, TransferRequest

MiB = 1 << 20
SEG = 80 * MiB


def digest(buf: np.ndarray) -> str:
    return hashlib.blake2b(buf.tobytes(), digest_size=16).hexdigest()


@pytest.fixture(scope="module")
def source():
    return pattern(7, SEG)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize(
    "length, remote_offset, local_offset",
    [(1, 0, 0), (1, SEG - 1, 3), (4097, 12345, 1), (MiB + 7, 3 * MiB + 1, 5), (64 * MiB, 13, 0)],
)
def test_read_then_write_verified_byte_for_byte(
    peer_factory, engine_factory, metadata, source, transport, length, remote_offset, local_offset
):
    peer = peer_factory("peer-a/kv", SEG)
    peer.fill(7)
    te = engine_factory(directory=metadata.url, transport=transport)
    buf = np.zeros(local_offset + length, dtype=np.uint8)
    got = te.read(buf, "peer-a/kv", remote_offset, local_offset=local_offset)
    assert got == length
    assert np.array_equal(buf[local_offset:], source[remote_offset : remote_offset + length])
    assert not buf[:local_offset].any()  # nothing written before the requested range

    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
    dst = (remote_offset + 17) % (SEG - length + 1)
    assert te.write(data, "peer-a/kv", dst) == length
    assert peer.digest(dst, length) == digest(data)
    if dst > 0:  # the byte before the written range is untouched
        assert peer.digest(dst - 1, 1) == digest(source[dst - 1 : dst])
    assert te.stats.snapshot().bytes[(transport, "write")] == length


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_batch_of_1000_mixed_reads_and_writes(peer_factory, engine_factory, metadata, transport):
    peer = peer_factory("peer-b/kv", 16 * MiB)
    peer.fill(3)
    source = pattern(3, 16 * MiB)
    te = engine_factory(directory=metadata.url, transport=transport)
    rng = np.random.default_rng(0)
    local = np.zeros(1000 * 4096, dtype=np.uint8)
    payload = rng.integers(0, 256, 500 * 1000, dtype=np.uint8)
    reqs, expect = [], []
    for i in range(1000):
        n = int(rng.integers(1, 4096))
        if i % 2 == 0:
            off = int(rng.integers(0, 8 * MiB - n))  # reads from the lower half
            reqs.append(TransferRequest(Op.READ, local, "peer-b/kv", off, n, i * 4096))
            expect.append((i * 4096, source[off : off + n]))
        else:  # writes to the upper half, 1000-byte slots
            off = 8 * MiB + (i // 2) * 1000
            chunk = payload[(i // 2) * 1000 : (i // 2) * 1000 + min(n, 1000)]
            reqs.append(TransferRequest(Op.WRITE, chunk, "peer-b/kv", off))
    statuses = te.submit(reqs).wait(timeout=60)
    assert len(statuses) == 1000 and all(s.ok for s in statuses), statuses[:3]
    for start, want in expect:
        assert np.array_equal(local[start : start + len(want)], want)
    written = peer.digest(8 * MiB, 500 * 1000)
    merged = pattern(3, 16 * MiB)[8 * MiB : 8 * MiB + 500 * 1000]
    for i in range(1, 1000, 2):
        n = reqs[i].length if reqs[i].length is not None else len(reqs[i].local)
        merged[(i // 2) * 1000 : (i // 2) * 1000 + n] = payload[(i // 2) * 1000 :][:n]
    assert written == digest(merged)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_concurrent_submitters(peer_factory, engine_factory, metadata, transport):
    peer = peer_factory("peer-c/kv", 32 * MiB)
    peer.fill(11)
    source = pattern(11, 32 * MiB)
    te = engine_factory(directory=metadata.url, transport=transport)
    errors: list[str] = []

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        for _ in range(20):
            n = int(rng.integers(1, 2 * MiB))
            off = int(rng.integers(0, 32 * MiB - n))
            buf = np.zeros(n, dtype=np.uint8)
            te.read(buf, "peer-c/kv", off, timeout=30)
            if not np.array_equal(buf, source[off : off + n]):
                errors.append(f"thread {k}: mismatch at {off}+{n}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert te.stats.snapshot().requests[(transport, "read")] == 120


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_peer_killed_mid_batch_fails_requests_then_recovers(
    peer_factory, engine_factory, metadata, transport
):
    peer = peer_factory("peer-d/kv", 64 * MiB)
    te = engine_factory(directory=metadata.url, transport=transport)
    local = np.zeros(64 * MiB, dtype=np.uint8)
    reqs = [TransferRequest(Op.READ, local, "peer-d/kv", 0) for _ in range(40)]  # 2.5 GiB
    handle = te.submit(reqs)
    time.sleep(0.05)
    peer.kill()
    statuses = handle.wait(timeout=60)  # never hangs
    failed = [s for s in statuses if s.state is State.FAILED]
    assert failed, "killing the peer must fail the requests still in flight"
    assert all(isinstance(s.error, TransferError) for s in failed)
    assert all(s.bytes_moved < 64 * MiB or s.ok for s in statuses)  # partial is never done
    with pytest.raises(TransferError):
        te.read(np.zeros(10, np.uint8), "peer-d/kv")  # still dead: a clear error

    peer2 = peer_factory("peer-d/kv", 64 * MiB)  # restarted: new port, new owner
    peer2.fill(5)
    buf = np.zeros(1000, dtype=np.uint8)
    te.read(buf, "peer-d/kv", 100)
    assert np.array_equal(buf, pattern(5, 64 * MiB)[100:1100])


def test_timeout_of_a_stalled_peer_then_recovery(peer_factory, engine_factory, metadata):
    peer = peer_factory("peer-e/kv", 64 * MiB)
    peer.fill(1)
    te = engine_factory(directory=metadata.url, transport="tcp")
    buf = np.zeros(64 * MiB, dtype=np.uint8)
    te.read(buf[:10], "peer-e/kv")  # connected
    peer.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(KVPoolTimeoutError):
            te.read(buf, "peer-e/kv", timeout=0.5)
        assert time.monotonic() - t0 < 10
        assert te.stats.snapshot().errors["timeout"] == 1
        fresh = engine_factory(directory=metadata.url, transport="tcp")
        t0 = time.monotonic()
        with pytest.raises(KVPoolTimeoutError):  # the handshake itself stalls
            fresh.read(buf[:10], "peer-e/kv", timeout=0.5)
        assert time.monotonic() - t0 < 3
    finally:
        peer.resume()
    te.read(buf, "peer-e/kv", timeout=30)
    assert np.array_equal(buf, pattern(1, 64 * MiB))


def test_backpressure_bounds_inflight_bytes(peer_factory, engine_factory, metadata):
    peer = peer_factory("peer-f/kv", 8 * MiB)
    te = engine_factory(directory=metadata.url, transport="tcp", max_inflight_bytes="4MiB")
    buf = np.zeros(8 * MiB, dtype=np.uint8)
    te.read(buf[:1], "peer-f/kv")
    peer.pause()
    try:
        first = te.submit([TransferRequest(Op.READ, buf, "peer-f/kv", 0, 3 * MiB)], timeout=20)
        with pytest.raises(BackpressureError):
            te.submit([TransferRequest(Op.READ, buf, "peer-f/kv", 0, 2 * MiB)], block=False)
        t0 = time.monotonic()
        with pytest.raises(BackpressureError):  # blocking submit gives up at its deadline
            te.submit([TransferRequest(Op.READ, buf, "peer-f/kv", 0, 2 * MiB)], timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 5
        assert te.stats.snapshot().inflight_bytes == 3 * MiB
        small = te.submit([TransferRequest(Op.READ, buf, "peer-f/kv", 0, MiB)], block=False)
    finally:
        peer.resume()
    assert all(s.ok for s in first.wait(30) + small.wait(30))
    assert te.stats.snapshot().inflight_bytes == 0
    assert te.stats.snapshot().errors["backpressure"] == 2


def test_auto_picks_shm_for_same_host_and_tcp_for_plain_memory(
    peer_factory, engine_factory, metadata
):
    peer_factory("peer-g/shm", MiB)
    peer_factory("peer-g/plain", MiB, "--no-shm")
    te = engine_factory(directory=metadata.url)
    buf = np.zeros(MiB, dtype=np.uint8)
    te.read(buf, "peer-g/shm")
    te.read(buf, "peer-g/plain")
    stats = te.stats.snapshot()
    assert stats.bytes[("shm", "read")] == MiB
    assert stats.bytes[("tcp", "read")] == MiB


def test_repeated_striped_writes_never_lose_a_frame(peer_factory, engine_factory, metadata):
    """Large WRITEs go through the sender threads of two connections (a lost wake-up once
    stranded frames here until their deadline)."""
    peer = peer_factory("peer-h/kv", 16 * MiB, "--no-shm")
    te = engine_factory(directory=metadata.url, transport="tcp", request_timeout=10)
    for i in range(40):
        data = np.full(16 * MiB, i % 251, dtype=np.uint8)
        te.write(data, "peer-h/kv")
    assert peer.digest(0, 16 * MiB) == digest(np.full(16 * MiB, 39, dtype=np.uint8))
    assert te.stats.snapshot().errors == {}


def test_sync_and_async_callers_share_connections(peer_factory, engine_factory, metadata):
    """Synchronous calls read their own replies (reader role) while asynchronous batches on the
    same connections are read by the receiver threads; every byte lands where it belongs."""
    peer = peer_factory("peer-i/kv", 8 * MiB, "--no-shm")
    peer.fill(4)
    source = pattern(4, 8 * MiB)
    te = engine_factory(directory=metadata.url, transport="tcp")
    errors: list[str] = []

    def sync_reader(k: int) -> None:
        rng = np.random.default_rng(k)
        for _ in range(30):
            n = int(rng.integers(1, 256 * 1024))
            off = int(rng.integers(0, 8 * MiB - n))
            buf = np.zeros(n, np.uint8)
            te.read(buf, "peer-i/kv", off, timeout=30)
            if not np.array_equal(buf, source[off : off + n]):
                errors.append(f"sync {k} at {off}+{n}")

    def async_reader(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        for _ in range(10):
            bufs, reqs = [], []
            for _ in range(8):
                n = int(rng.integers(1, 3 * MiB))
                off = int(rng.integers(0, 8 * MiB - n))
                bufs.append((np.zeros(n, np.uint8), off))
                reqs.append(TransferRequest(Op.READ, bufs[-1][0], "peer-i/kv", off))
            statuses = te.submit(reqs, timeout=30).wait(60)
            for (buf, off), status in zip(bufs, statuses, strict=True):
                if not status.ok or not np.array_equal(buf, source[off : off + len(buf)]):
                    errors.append(f"async {k} at {off}+{len(buf)}: {status.reason}")

    threads = [threading.Thread(target=sync_reader, args=(k,)) for k in range(3)]
    threads += [threading.Thread(target=async_reader, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_one_synchronous_batch_to_several_peers(peer_factory, engine_factory, metadata, transport):
    """A waiting caller's batch that spans peers (a put to two replicas, a batch read across
    nodes) completes on every connection: each synchronous train is received."""
    peers = [peer_factory(f"peer-m{i}/kv", MiB) for i in range(3)]
    for i, peer in enumerate(peers):
        peer.fill(20 + i)
    te = engine_factory(directory=metadata.url, transport=transport)
    t0 = time.monotonic()
    data = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy()
    writes = [TransferRequest(Op.WRITE, data, f"peer-m{i}/kv", 100) for i in range(3)]
    assert [s.bytes_moved for s in te.transfer(writes, timeout=5)] == [4096] * 3
    bufs = [np.zeros(1000, dtype=np.uint8) for _ in range(6)]
    reads = [TransferRequest(Op.READ, b, f"peer-m{i % 3}/kv", 100 + 7 * i) for i, b in
             enumerate(bufs)]  # fmt: skip
    statuses = te.transfer_statuses(reads, timeout=5)
    assert all(s.ok for s in statuses) and time.monotonic() - t0 < 5
    for peer in peers:
        assert peer.digest(100, 4096) == digest(data)
    for i, b in enumerate(bufs):
        assert np.array_equal(b, data[7 * i : 7 * i + 1000])


def _spy_quick(te) -> list:
    """Record what the TCP transport's quick exchange answered (None: not taken)."""
    tcp = te._transports["tcp"]
    seen: list = []
    real = tcp.exchange

    def spy(op, items, deadline):
        out = real(op, items, deadline)
        seen.append(out)
        return out

    tcp.exchange = spy
    return seen


def test_quick_exchange_moves_small_batches_and_times_out_on_a_stall(
    peer_factory, engine_factory, metadata
):
    """A small synchronous batch over an idle connection is moved by the caller's thread (the
    quick exchange): writes land, reads come back, a stalled peer is a timeout within the
    deadline (never a hang), and the next call dials again and succeeds."""
    peer = peer_factory("peer-q/kv", 8 * MiB, "--no-shm")
    peer.fill(9)
    source = pattern(9, 8 * MiB)
    te = engine_factory(directory=metadata.url, transport="tcp")
    te.read(np.zeros(16, np.uint8), "peer-q/kv")  # dials (the general path)
    seen = _spy_quick(te)
    data = np.random.default_rng(5).integers(0, 256, 8 * 65536, dtype=np.uint8)
    writes = [TransferRequest(Op.WRITE, data[i * 65536 : (i + 1) * 65536], "peer-q/kv",
                              MiB + 3 * i * 65536) for i in range(8)]  # fmt: skip
    assert [s.bytes_moved for s in te.transfer(writes, timeout=5)] == [65536] * 8
    for i in range(8):
        assert peer.digest(MiB + 3 * i * 65536, 65536) == digest(data[i * 65536 : (i + 1) * 65536])
    bufs = [np.zeros(1000 + i, np.uint8) for i in range(5)]
    reads = [TransferRequest(Op.READ, b, "peer-q/kv", 7 * i) for i, b in enumerate(bufs)]
    assert all(s.ok for s in te.transfer_statuses(reads, timeout=5))
    for i, b in enumerate(bufs):
        assert np.array_equal(b, source[7 * i : 7 * i + len(b)])
    assert len(seen) == 2 and all(out == [None] * n for out, n in zip(seen, (8, 5), strict=True))
    assert te.stats.snapshot().requests[("tcp", "write")] == 8

    peer.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(KVPoolTimeoutError):
            te.read(np.zeros(4096, np.uint8), "peer-q/kv", timeout=0.5)
        assert time.monotonic() - t0 < 2  # the deadline plus a stall check, not a hang
        assert seen[-1] is not None  # the quick exchange itself timed out
        assert te.stats.snapshot().errors["timeout"] == 1
    finally:
        peer.resume()
    buf = np.zeros(4096, np.uint8)
    te.read(buf, "peer-q/kv", 100, timeout=10)
    assert np.array_equal(buf, source[100 : 100 + 4096])

"""Wire helpers and segment plumbing."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest
import torch

from kvpool.common.errors import BadRequestError
from kvpool.transfer import protocol as P
from kvpool.transfer.segment import (
    SHM_DIR,
    SegmentDescriptor,
    SharedRegion,
    byte_view,
    new_shm_name,
    reap_stale_shm,
)


@pytest.mark.parametrize(
    "fields, message",
    [
        ((3, 0, 0, 1, 1, 0, 1), "unknown op"),
        ((1, 2, 0, 1, 1, 0, 1), "flags"),
        ((1, 0, 1, 1, 1, 0, 1), "reserved"),
        ((1, 0, 0, 1, 1, 0, 0), "length 0"),
        ((2, 0, 0, 1, 1, 0, P.MAX_FRAME_BYTES + 1), "not in"),
    ],
)
def test_parse_request_rejects_malformed_headers(fields, message):
    with pytest.raises(P.FrameError, match=message):
        P.parse_request(P.REQUEST.pack(*fields))


def test_parse_request_accepts_a_valid_header():
    head = P.REQUEST.pack(P.Op.WRITE, P.FLAG_END, 0, 7, 42, 100, 5)
    assert P.parse_request(head) == (P.Op.WRITE, P.FLAG_END, 7, 42, 100, 5)
    assert P.REQUEST.size == 32 and P.RESPONSE.size == 24


def test_sendmsg_all_and_recv_exact_with_short_writes():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.settimeout(60)  # a stuck send fails the test instead of hanging it
    b.settimeout(60)
    parts = [os.urandom(n) for n in (1, 100_000, 0, 7, 3_000_000)]
    total = sum(map(len, parts))
    out, rest = bytearray(total), bytearray(2000)
    # The reader drains everything the sender writes (with a 4 KiB send buffer, bytes left
    # unread would block the sender for good): two reads, the second one into its own buffer.
    reader = threading.Thread(
        target=lambda: (P.recv_exact(b, memoryview(out)), P.recv_exact(b, memoryview(rest)))
    )
    reader.start()
    P.sendmsg_all(a, parts + [b"x"] * 2000)  # > 512 buffers: several sendmsg calls
    reader.join(60)
    assert not reader.is_alive()
    assert bytes(out) == b"".join(parts)
    assert rest == b"x" * 2000
    a.close()
    with pytest.raises(ConnectionError):
        P.recv_exact(b, memoryview(bytearray(1)))
    b.close()


def test_shared_region_is_visible_to_a_second_mapping():
    name = new_shm_name("t/x y")
    assert "/" not in name and " " not in name
    owner = SharedRegion(name, 10_000, create=True)
    peer = SharedRegion(name, 10_000, create=False)
    owner.array[5:9] = [1, 2, 3, 4]
    assert peer.array[5:9].tolist() == [1, 2, 3, 4]
    with pytest.raises(BadRequestError):
        SharedRegion(name, 20_000, create=False)  # larger than the file
    peer.close()
    owner.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_reap_stale_shm_removes_files_of_dead_owners():
    dead = "kvpool-999999999-deadbeef-x"
    alive = new_shm_name("alive")
    for n in (dead, alive):
        open(os.path.join(SHM_DIR, n), "wb").close()
    assert reap_stale_shm() >= 1
    assert not os.path.exists(os.path.join(SHM_DIR, dead))
    assert os.path.exists(os.path.join(SHM_DIR, alive))
    os.unlink(os.path.join(SHM_DIR, alive))


def test_byte_view_accepts_buffers_and_tensors():
    assert len(byte_view(np.zeros(3, np.float64), writable=True)) == 24
    assert len(byte_view(torch.zeros(2, 3, dtype=torch.bfloat16), writable=True)) == 12
    assert len(byte_view(bytearray(5), writable=True)) == 5
    assert len(byte_view(b"abc", writable=False)) == 3
    with pytest.raises(BadRequestError):
        byte_view(torch.zeros(4, 4).t(), writable=False)
    with pytest.raises(BadRequestError):
        byte_view(42, writable=False)


def test_descriptor_round_trip_and_validation():
    d = SegmentDescriptor("n", 1, "h", 2, 3, "o", 4, "b", new_shm_name("n"))
    assert SegmentDescriptor.from_dict(d.to_dict()) == d
    assert SegmentDescriptor.from_dict({**d.to_dict(), "extra": 1}) == d
    with pytest.raises(BadRequestError):
        SegmentDescriptor.from_dict({"name": "n"})
    with pytest.raises(BadRequestError):
        SegmentDescriptor.from_dict(["not", "a", "map"])
    for field, value in [("shm_name", "../x"), ("shm_name", "/dev/shm/kvpool-1-00000000-a"),
                         ("shm_name", "kvpool-1-00000000-a/b"), ("shm_name", "other-file"),
                         ("size", 0), ("size", True), ("port", 70000), ("segment_id", 0),
                         ("pid", -1), ("host", "a b"), ("host", ""), ("boot_id", "x" * 65),
                         ("name", "a\0b"), ("name", 7)]:  # fmt: skip
        with pytest.raises(BadRequestError, match=field):
            SegmentDescriptor.from_dict({**d.to_dict(), field: value})


def test_peers_map_only_plain_shm_files_of_their_own_user(tmp_path):
    """A forged descriptor cannot make a peer map a symlink, a directory or a path."""

    target = tmp_path / "victim.txt"
    target.write_bytes(b"secret" * 1000)
    link = new_shm_name("evil")
    os.symlink(target, os.path.join(SHM_DIR, link))
    try:
        with pytest.raises(BadRequestError, match="cannot open"):
            SharedRegion(link, 4096, create=False)  # O_NOFOLLOW
    finally:
        os.unlink(os.path.join(SHM_DIR, link))
    for name in ["../../etc/passwd", str(target)]:
        with pytest.raises(BadRequestError, match="not a kvpool shared-memory name"):
            SharedRegion(name, 4096, create=False)


def test_a_driver_with_nothing_to_read_on_a_connection_returns():
    """A striped request's frames travel on two connections; the caller drives each in turn.
    On the one whose frames are all received (by its receiver thread), with nothing queued,
    drive must return (the caller then waits for the handle) instead of waiting for a
    notify that never comes (that polled every 50 ms: 4 MiB gets took 52 ms instead of 2)."""
    import socket
    import threading

    from kvpool.transfer.transports.tcp_conn import Connection

    a, b = socket.socketpair()
    conn = Connection(a, "test-peer", inline_bytes=1 << 20)
    try:
        done = threading.Event()
        t = threading.Thread(target=lambda: (conn.drive(None, lambda: False), done.set()))
        t.start()
        assert done.wait(5), "drive kept waiting on a connection with nothing to read"
        t.join(5)
    finally:
        conn.abort("test over")
        b.close()

"""Fuzzed frames never crash the transfer server nor touch memory outside a segment."""

from __future__ import annotations

import contextlib
import socket
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.transfer import protocol as P

N = 64 << 10


@pytest.fixture(scope="module")
def target():
    """A served segment followed in memory by a guard region that nothing may touch."""
    from kvpool.config import TransferConfig
    from kvpool.transfer import TransferEngine

    owner = TransferEngine(TransferConfig())
    backing = np.zeros(2 * N, dtype=np.uint8)
    seg = owner.register("fuzz/target", backing[:N])
    guard = np.random.default_rng(0).integers(0, 256, N, dtype=np.uint8)
    backing[N:] = guard
    client = TransferEngine(TransferConfig(transport="tcp"))
    yield owner, seg, backing, guard, client
    client.close()
    owner.close()


def recv_n(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n and (chunk := s.recv(n - len(out))):
        out += chunk
    return out


def connect(port: int, handshake: bool) -> socket.socket:
    """A raw connection, past the (open server's) handshake if ``handshake``."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if handshake:
        s.sendall(P.HELLO.pack(P.MAGIC, P.VERSION, 0, bytes(16)))
        magic, status, wants_proof, _, _ = P.CHALLENGE.unpack(recv_n(s, P.CHALLENGE.size))
        assert (magic, status, wants_proof) == (P.MAGIC, P.Status.OK, 0)
        s.sendall(P.PROOF.pack(P.NO_PROOF))
        assert recv_n(s, P.WELCOME.size) == P.WELCOME.pack(P.MAGIC, P.Status.OK)
    return s


def assert_healthy(target) -> None:
    _owner, _seg, backing, guard, client = target
    assert np.array_equal(backing[N:], guard), "a frame wrote outside the segment"
    buf = np.zeros(16, np.uint8)
    assert client.read(buf, "fuzz/target", N - 16, timeout=10) == 16  # still serving


frames = st.tuples(
    st.sampled_from([0, 1, 2, 3, 255]),  # op
    st.sampled_from([0, 1, 2, 0x81]),  # flags
    st.sampled_from([0, 0, 0, 7]),  # reserved
    st.sampled_from(["target", 0, 999, 2**32 - 1]),  # segment id
    st.one_of(st.sampled_from([0, N - 1, N, N + 1, 2**63, 2**64 - 1]), st.integers(0, 2 * N)),
    st.one_of(
        st.sampled_from([0, 1, N, N + 1, P.MAX_FRAME_BYTES, P.MAX_FRAME_BYTES + 1, 2**64 - 1]),
        st.integers(1, 4096),
    ),
    st.binary(max_size=4096),  # payload actually sent (may be shorter than announced)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames, min_size=1, max_size=8), st.booleans())
def test_fuzzed_frame_trains(target, train, read_replies):
    owner, seg, _backing, _guard, _client = target
    with connect(owner.port, handshake=True) as s:
        for op, flags, reserved, seg_id, offset, length, payload in train:
            sid = seg.segment_id if seg_id == "target" else seg_id
            head = struct.pack("<BBHIQQQ", op, flags, reserved, sid, 1, offset, length)
            try:
                s.sendall(head + payload)
            except OSError:
                break  # the server already dropped us: fine
        if read_replies:
            s.settimeout(0.2)
            try:
                while s.recv(1 << 16):
                    pass
            except OSError:
                pass
    assert_healthy(target)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=2048))
def test_garbage_before_the_handshake(target, junk):
    owner = target[0]
    with connect(owner.port, handshake=False) as s, contextlib.suppress(OSError):
        s.sendall(junk)
    assert_healthy(target)


def test_bad_magic_and_version(target):
    owner = target[0]
    with connect(owner.port, handshake=False) as s:
        s.sendall(P.HELLO.pack(b"HTTP", P.VERSION, 0, bytes(16)))
        assert s.recv(16) == b""  # closed without a reply
    with connect(owner.port, handshake=False) as s:
        s.sendall(P.HELLO.pack(P.MAGIC, 1, 0, bytes(16)))  # version 1 sent the token itself
        reply = P.CHALLENGE.unpack(recv_n(s, P.CHALLENGE.size))
        assert reply[1] == P.Status.BAD_VERSION and s.recv(16) == b""
    assert_healthy(target)


def test_valid_frames_are_answered_in_order(target):
    owner, seg, backing, _guard, _client = target
    backing[:N] = 5
    with connect(owner.port, handshake=True) as s:
        s.sendall(
            P.REQUEST.pack(P.Op.WRITE, 0, 0, seg.segment_id, 1, 10, 3)
            + b"abc"
            + P.REQUEST.pack(P.Op.READ, 0, 0, seg.segment_id, 2, 9, 5)
            + P.REQUEST.pack(P.Op.READ, P.FLAG_END, 0, seg.segment_id, 3, N - 1, 2)
        )
        s.settimeout(5)
        want = (
            P.RESPONSE.pack(0, P.Op.WRITE, 0, 0, 1, 0)
            + P.RESPONSE.pack(0, P.Op.READ, 0, 0, 2, 5)
            + b"\x05abc\x05"
            + P.RESPONSE.pack(P.Status.OUT_OF_BOUNDS, P.Op.READ, 0, 0, 3, 2)
            + b"\0\0"  # a refused READ still carries its length, as zeros
        )
        got = b""
        while len(got) < len(want):
            chunk = s.recv(4096)
            assert chunk
            got += chunk
        assert got == want


def test_a_real_peer_process_survives_garbage(peer_factory, engine_factory, metadata):
    peer = peer_factory("fuzz-proc/kv", 1 << 20)
    peer.fill(2)
    for junk in (b"\0" * 100, b"KVTE\x01\x00\x00\x00" + b"\xff" * 64, b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", peer.port), timeout=5) as s:
            s.sendall(junk)
    te = engine_factory(directory=metadata.url, transport="tcp")
    buf = np.zeros(4096, np.uint8)
    te.read(buf, "fuzz-proc/kv", 1000)
    from kvpool.entrypoints.transfer import pattern

    assert np.array_equal(buf, pattern(2, 1 << 20)[1000:5096])

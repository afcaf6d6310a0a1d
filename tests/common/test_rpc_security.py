"""The RPC's handshake, roles and limits, over real sockets: what a hostile or broken peer can
and cannot make a server do."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from support.raw_rpc import frame, handshake, raw_conn, read_frame, request, serve_handshake

from kvpool.common import auth
from kvpool.common.errors import AuthError, ForbiddenError, ProtocolError
from kvpool.common.rpc import (
    PROTOCOL_VERSION,
    RpcClient,
    RpcServer,
    ServerLimits,
    current_call,
    pack,
    rpc_method,
)


class Handler:
    @rpc_method
    def add(self, a, b=0):
        return a + b

    @rpc_method(bulk=True)
    def count(self, items):
        return len(items)

    @rpc_method
    def whoami(self):
        ctx = current_call()
        return [ctx.client_id, ctx.role]

    @rpc_method
    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds

    @rpc_method(admin=True)
    def wipe(self):
        return "wiped"


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closes ``sock`` within ``seconds`` (whatever it sends first)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    with contextlib.suppress(OSError):
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    return False


def test_token_is_proven_both_ways_and_never_sent():
    seen = bytearray()
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor():  # knows the protocol, not the token
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            serve_handshake(conn, token="not-the-token")
            with contextlib.suppress(OSError):
                while data := conn.recv(4096):
                    seen.extend(data)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    with RpcClient(address, token="s3cret-token") as c, pytest.raises(AuthError, match="prove"):
        c.call("add", 1, 2)
    t.join(5)
    listener.close()
    assert b"add" not in seen  # the request never went to the impostor
    assert b"s3cret-token" not in seen


def test_a_client_with_a_token_refuses_an_open_server():
    with (
        RpcServer(Handler(), token="") as srv,
        RpcClient(srv.address, token="t") as c,
        pytest.raises(AuthError, match="runs without one"),
    ):
        c.call("add", 1, 2)


def test_token_from_the_environment(monkeypatch):
    monkeypatch.setenv(auth.AUTH_ENV, "from-env")
    with RpcServer(Handler()) as srv:  # None: the environment's token
        with RpcClient(srv.address) as c:
            assert c.call("add", 1, 2) == 3
        with RpcClient(srv.address, token="") as c, pytest.raises(AuthError):
            c.call("add", 1, 2)


def test_bad_proofs_are_refused_and_the_connection_closed():
    with RpcServer(Handler(), token="right") as srv:
        for token in [None, "wrong"]:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
                welcome = handshake(s, token)
                assert welcome[1] is False and welcome[2]["type"] == "AuthError"
                assert closed_within(s, 2)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            hello = read_frame(s)
            assert hello[3] is True  # the server says it wants a proof
            s.sendall(request("add", 1, [1, 2]))  # a request instead of a hello
            assert read_frame(s)[2]["type"] == "ProtocolError"
            assert closed_within(s, 2)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            read_frame(s)
            s.sendall(frame(b"\x00" * 1024))  # over the hello's 512 bytes
            assert read_frame(s)[2]["type"] == "PayloadTooLargeError"
        assert srv.stats["auth_failures"] == 2
        with raw_conn(srv.port, token="right") as s:
            s.sendall(request("add", 7, [1, 2]))
            assert read_frame(s) == [7, True, 3]


def test_replayed_proofs_do_not_work():
    """A proof answers one server nonce: sent again on a new connection it fails."""
    with RpcServer(Handler(), token="right") as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            hello = read_frame(s)
            nonce = auth.new_nonce()
            good = auth.proof(auth.derive_key("right", auth.RPC), b"client", hello[2], nonce)
            s.sendall(frame(pack([PROTOCOL_VERSION, nonce, "member", good, "x"])))
            assert read_frame(s)[0] is True
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            read_frame(s)
            s.sendall(frame(pack([PROTOCOL_VERSION, nonce, "member", good, "x"])))
            assert read_frame(s)[2]["type"] == "AuthError"


def test_admin_calls_need_the_admin_token():
    with RpcServer(Handler(), token="member-t", admin_token="admin-t") as srv:
        with RpcClient(srv.address, token="member-t") as c:
            assert c.call("whoami") == [c.client_id, "member"]
            with pytest.raises(ForbiddenError, match="admin"):
                c.call("wipe")
        with RpcClient(srv.address, admin_token="admin-t") as c:
            assert c.call("wipe") == "wiped" and c.call("whoami")[1] == "admin"
        with RpcClient(srv.address, admin_token="member-t") as c, pytest.raises(AuthError):
            c.call("wipe")
    with (
        RpcServer(Handler(), token="member-t", admin_token="") as srv,  # no admin token
        RpcClient(srv.address, admin_token="anything") as c,
        pytest.raises(AuthError, match="admin calls are disabled"),
    ):
        c.call("wipe")
    with RpcServer(Handler(), token="", admin_token="") as srv, RpcClient(srv.address) as c:
        assert c.call("wipe") == "wiped"  # open mode: no authorization either


def test_silent_and_stalled_connections_are_closed():
    with RpcServer(
        Handler(), token="", limits=ServerLimits(handshake_timeout=0.5, idle_timeout=0.5)
    ) as srv:
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        stalled = raw_conn(srv.port)
        stalled.sendall((1000).to_bytes(4, "big") + b"part of a frame")
        idle = raw_conn(srv.port)  # a whole-frame boundary: kept (clients reuse connections)
        t0 = time.monotonic()
        assert closed_within(silent, 3) and closed_within(stalled, 3)
        assert time.monotonic() - t0 < 3
        idle.sendall(request("add", 3, [1, 1]))
        assert read_frame(idle) == [3, True, 2]
        for s in (silent, stalled, idle):
            s.close()


def test_unauthenticated_connections_are_capped():
    with RpcServer(Handler(), token="t", limits=ServerLimits(max_unauthenticated=4)) as srv:
        squatters = [socket.create_connection(("127.0.0.1", srv.port), timeout=5)
                     for _ in range(4)]  # fmt: skip
        for s in squatters:
            read_frame(s)  # accepted: greeted
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        assert closed_within(extra, 2)
        for s in squatters:
            s.close()
        time.sleep(0.3)
        with RpcClient(srv.address, token="t") as c:
            assert c.call("add", 2, 2) == 4


def test_element_budgets_stop_amplification():
    with RpcServer(Handler()) as srv, RpcClient(srv.address) as c:
        assert c.call("count", [[]] * 30_000) == 30_000  # each empty array counts as one
        with pytest.raises(ProtocolError, match="elements"):
            c.call("count", [[[]] * 1000] * 100)  # 100,000 arrays in 300 KB
        with pytest.raises(ProtocolError, match="max_array_len"):
            c.call("add", list(range(5000)))  # a small method: 4,096 elements at most
        assert c.call("add", 1, 2) == 3


def test_large_partial_frames_share_one_budget():
    with RpcServer(Handler(), limits=ServerLimits(max_buffered=1 << 20)) as srv:
        first = raw_conn(srv.port)
        first.sendall((800_000).to_bytes(4, "big") + b"\x94")
        time.sleep(0.2)
        second = raw_conn(srv.port)
        second.sendall((800_000).to_bytes(4, "big") + b"\x94")
        assert read_frame(second)[2]["type"] == "BackpressureError"
        assert closed_within(second, 2)
        first.close()
        time.sleep(0.2)
        with RpcClient(srv.address) as c:
            assert c.call("count", [b"x" * 700_000]) == 1  # the budget came back


def test_a_client_that_never_reads_does_not_spin_the_server():
    with RpcServer(Handler()) as srv, raw_conn(srv.port) as greedy:
        many = request("add", 1, [b"y" * 60_000, b""])  # 60 KB replies, never read
        greedy.settimeout(1)
        with contextlib.suppress(TimeoutError):
            for _ in range(2000):
                greedy.sendall(many)
        time.sleep(0.5)  # the server has stopped reading this connection by now
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(1.5)
        busy = (time.process_time() - cpu0) / (time.monotonic() - t0)
        assert busy < 0.3, f"the server loop burns {busy:.0%} of a core on a stuck client"
        unsent = max(len(c.outbuf) for c in srv._conns.values())
        assert unsent <= 48 << 20  # it stopped reading that client: memory is bounded
        with RpcClient(srv.address) as c:
            assert c.call("add", 1, 2) == 3


def test_requests_of_one_connection_are_capped_on_the_pool():
    with RpcServer(Handler(), workers=4) as srv, raw_conn(srv.port, timeout=30) as s:
        s.sendall(b"".join(request("sleep", i, [0.02]) for i in range(1, 201)))
        replies = [read_frame(s) for _ in range(200)]
        busy = [r for r in replies if r[1] is False]
        assert busy and all(r[2]["type"] == "BackpressureError" for r in busy)
        assert len(busy) <= 200 - 64  # 64 queued at once per connection, the rest refused

"""The control-plane RPC over real TCP sockets on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.raw_rpc import frame, raw_reply, recv_exact, request, serve_handshake

from kvpool.common.errors import (
    BadRequestError,
    ConnectionLostError,
    KVPoolError,
    KVPoolTimeoutError,
    NotFoundError,
    PayloadTooLargeError,
    ProtocolError,
    RejectedError,
)
from kvpool.common.rpc import AuthError, RpcClient, RpcServer, ServerLimits, pack, rpc_method


class Handler:
    """Exposes a few methods; ``hidden`` and ``_private`` must stay unreachable."""

    @rpc_method(bulk=True)
    def echo(self, value):
        return value

    @rpc_method
    def add(self, a, b=0):
        return a + b

    @rpc_method
    def repeat(self, data, n):
        return data * n

    @rpc_method
    def kw(self, a, *, scale=1, label="x"):
        return {"a": a, "scale": scale, "label": label}

    @rpc_method
    def not_found(self, key):
        raise NotFoundError(f"no such key {key}", param="key")

    @rpc_method
    def rejected(self):
        raise RejectedError("queue full", retry_after=2.5, reason="queue")

    @rpc_method
    def crash(self):
        return 1 // 0

    @rpc_method
    def unserializable(self):
        return object()

    @rpc_method
    def sleep(self, seconds, tag):
        time.sleep(seconds)
        return tag

    def hidden(self):
        return "secret"

    def _private(self):
        return "secret"

    @rpc_method
    def _marked_private(self):  # underscore names stay private even when marked
        return "secret"


@pytest.fixture(scope="module", params=[1, 4], ids=["inline", "pool4"])
def server(request):
    with RpcServer(Handler(), workers=request.param) as srv:
        yield srv


@pytest.fixture
def client(server):
    with RpcClient(server.address, timeout=5.0) as c:
        yield c


def raw_conn(server: RpcServer) -> socket.socket:
    from support.raw_rpc import raw_conn as connect

    return connect(server.port)


MIB = os.urandom(1 << 20)
VALUES = [
    None,
    True,
    False,
    0,
    -1,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1.5,
    -0.0,
    float("inf"),
    1e-300,
    "",
    "héllo ✓",
    b"",
    b"\x00\xff",
    MIB,
    [1, "two", b"three", None, [4.0]],
    {"a": 1, 2: "int key", "nested": {"b": [True, b"x"]}},
]


def test_roundtrip_all_types(client):
    for value in VALUES:
        out = client.call("echo", value)
        assert out == value
        assert type(out) is type(value)
    assert client.call("echo", (1, 2)) == [1, 2]  # tuples arrive as lists
    assert client.call("echo", MIB) == MIB


ints = st.integers(-(2**63), 2**64 - 1)
scalars = (
    st.none()
    | st.booleans()
    | ints
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=64)
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8) | ints, c),
    max_leaves=20,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=values)
def test_roundtrip_random_values(server, value):
    with RpcClient(server.address) as c:
        assert c.call("echo", value) == value


def test_args_and_kwargs(client):
    assert client.call("add", 2, 3) == 5
    assert client.call("add", 2, b=40) == 42
    assert client.call("add", a=b"ab", b=b"cd") == b"abcd"
    assert client.call("kw", 7, label="y") == {"a": 7, "scale": 1, "label": "y"}


def test_typed_errors_travel(client):
    with pytest.raises(NotFoundError) as info:
        client.call("not_found", "k1")
    assert info.value.message == "no such key k1"
    assert str(info.value) == "no such key k1"
    assert info.value.param == "key"
    with pytest.raises(RejectedError) as info:
        client.call("rejected")
    assert (info.value.retry_after, info.value.reason, info.value.http_status) == (
        2.5,
        "queue",
        429,
    )


def test_internal_errors_do_not_kill_the_server(client):
    for method in ["crash", "unserializable"]:
        with pytest.raises(KVPoolError) as info:
            client.call(method)
        assert type(info.value) is KVPoolError
        assert info.value.message == f"internal error in {method}"
        assert client.call("add", 1, 1) == 2


def test_unknown_and_unexposed_methods(client):
    for name in [
        "nope",
        "hidden",
        "_private",
        "_marked_private",
        "__init__",
        "__class__",
        "__dict__",
    ]:
        with pytest.raises(BadRequestError, match="unknown method"):
            client.call(name)
    with pytest.raises(BadRequestError, match="bad arguments"):
        client.call("add", 1, 2, 3)
    with pytest.raises(BadRequestError, match="bad arguments"):
        client.call("add", 1, c=3)
    assert client.call("add", 1, 2) == 3


def test_handler_tables():
    with pytest.raises(ValueError, match="no @rpc_method"):
        RpcServer(object())
    with pytest.raises(TypeError):
        RpcServer({"x": 42})
    with RpcServer({"twice": lambda x: 2 * x}) as srv, RpcClient(srv.address) as c:
        assert c.call("twice", 21) == 42


def test_timeout_then_next_call_gets_its_own_reply(server, client):
    t0 = time.monotonic()
    with pytest.raises(KVPoolTimeoutError):
        client.call("sleep", 0.6, "late", timeout=0.2)
    elapsed = time.monotonic() - t0
    assert 0.15 <= elapsed < 3.0
    assert client.call("sleep", 0.0, "fresh") == "fresh"
    time.sleep(0.7)  # the late reply has surely been sent by now
    assert client.call("echo", "next") == "next"


def test_client_discards_stale_and_malformed_replies():
    """A hand-made server answers every request with junk and a stale id before the real reply."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve():
        conn = None
        while conn is None and not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
        if conn is None:
            return
        with conn:
            conn.settimeout(5)
            serve_handshake(conn)
            while not stop.is_set():
                try:
                    header = recv_exact(conn, 4)
                except (AssertionError, OSError):
                    return
                _, rid, args, _ = msgpack.unpackb(
                    recv_exact(conn, int.from_bytes(header, "big")), raw=False
                )
                for junk in [
                    b"\xc1garbage",
                    pack([rid - 1, True, "stale"]),
                    pack([True, True, "bool id"]),
                    pack([rid, "yes", "ok is not a bool"]),
                    pack([rid, True]),
                    pack([rid, True, args[0]]),
                ]:
                    conn.sendall(frame(junk))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with RpcClient(f"127.0.0.1:{port}", timeout=3.0) as c:
            assert [c.call("x", i) for i in range(1, 6)] == [1, 2, 3, 4, 5]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_oversized_reply_header_breaks_the_connection():
    """A reply announcing more than the client's limit is not waited for."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        with conn:
            serve_handshake(conn)
            conn.recv(4096)
            conn.sendall((1 << 31).to_bytes(4, "big"))
            time.sleep(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with RpcClient(f"127.0.0.1:{port}", timeout=3.0, max_message_size=1 << 20) as c:
            t0 = time.monotonic()
            with pytest.raises(ConnectionLostError, match="exceeds"):
                c.call("x", 1)
            assert time.monotonic() - t0 < 1.0
    finally:
        thread.join(5)
        listener.close()


def test_auth_token():
    with RpcServer(Handler(), token="s3cret") as srv:
        for token in [None, "", "wrong", "s3cret!"]:
            with RpcClient(srv.address, token=token) as c, pytest.raises(AuthError) as info:
                c.call("add", 1, 2)
            assert info.value.http_status == 401
        with RpcClient(srv.address, token="s3cret") as c:
            assert c.call("add", 1, 2) == 3
    for host in ["0.0.0.0", "::"]:
        for token in [None, ""]:
            with pytest.raises(ValueError, match="token"):
                RpcServer(Handler(), host=host, token=token)
    with (
        RpcServer(Handler(), host="0.0.0.0", token="t") as srv,
        RpcClient(f"127.0.0.1:{srv.port}", token="t") as c,
    ):
        assert c.call("add", 2, 2) == 4


MALFORMED = [
    b"",
    b"\xc1",
    b"\x01\x02",  # two values in one message
    pack(1),
    pack([]),
    pack(["add", 1, [1, 2]]),
    pack({"method": "add"}),
    pack([1, 11, [1, 2], {}]),  # v1's layout
    pack(["add", True, [1, 2], {}]),
    pack(["add", "13", [1, 2], {}]),
    pack([123, 14, [1, 2], {}]),
    pack(["add", 15, "1,2", {}]),
    pack(["add", 16, [1], {1: 2}]),
    pack(["add", 17, [1], []]),
    pack(["add", 18, ["a", 1], {}]),  # passes checks; the handler's TypeError
    pack(["nope", 19, [], {}]),
    pack(["add", -20, [1, 2], {}]),
    pack(["a" * 40, 21, [], {}]),  # a method name longer than a fixstr
    msgpack.packb(msgpack.ExtType(5, b"x")),
    pack(["add", 22, [msgpack.ExtType(5, b"x")], {}]),
    b"\x94\xa3add\x17" + b"\x91" * 2000,  # deeply nested arrays
    b"\x94\xa3add\x18" + b"\xdd\x7f\xff\xff\xff",  # announces 2**31 elements
]


def test_malformed_messages_get_error_replies(server, client):
    with raw_conn(server) as sock:
        for payload in MALFORMED:
            sock.sendall(frame(payload))
            reply = raw_reply(sock)
            assert reply[1] is False, payload
            assert reply[2]["type"] in {"ProtocolError", "BadRequestError", "KVPoolError"}
        sock.sendall(frame(pack(["add", 11, "x", {}])))
        assert raw_reply(sock)[0] == 11  # the id is echoed whenever it could be read
        sock.sendall(request("add", 19, [1, 2]))
        assert raw_reply(sock) == [19, True, 3]  # the connection survived all of it
    assert client.call("add", 1, 2) == 3


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=4096))
def test_random_payloads(server, data):
    with raw_conn(server) as sock:
        sock.sendall(frame(data))
        reply = raw_reply(sock)
        assert reply[1] is False
        assert reply[2]["type"] in {ProtocolError.__name__, BadRequestError.__name__}
    with RpcClient(server.address) as c:
        assert c.call("add", 1, 2) == 3


def test_requests_split_and_pipelined(server):
    """Frames cut into single bytes, and many frames in one send, are all answered in order
    of arrival (workers=1) or at least all answered (pool)."""
    requests = [request("add", i, [i, 1]) for i in range(1, 51)]
    with raw_conn(server) as sock:
        for byte in requests[0]:
            sock.sendall(bytes([byte]))
            time.sleep(0.001)
        assert raw_reply(sock) == [1, True, 2]
        sock.sendall(b"".join(requests[1:]))
        replies = [raw_reply(sock) for _ in range(49)]
    assert sorted(r[0] for r in replies) == list(range(2, 51))
    assert all(r[2] == r[0] + 1 for r in replies)


def test_oversized_frames_are_refused():
    with RpcServer(Handler(), limits=ServerLimits(max_message_size=1 << 17)) as srv:
        with raw_conn(srv) as sock:
            sock.sendall((1 << 18).to_bytes(4, "big") + os.urandom(4096))
            reply = raw_reply(sock)
            assert reply[1] is False and "exceeds the limit" in reply[2]["message"]
            assert sock.recv(10) == b""  # and the connection is closed
        with RpcClient(srv.address, timeout=2) as c:
            with pytest.raises(PayloadTooLargeError, match="exceeds the limit"):
                c.call("echo", b"x" * (1 << 18))  # the server's limit, not the client's
            assert c.call("echo", b"x" * 100_000) == b"x" * 100_000  # a bulk method
            with pytest.raises(PayloadTooLargeError, match="exceeds its limit of 65536"):
                c.call("add", b"x" * 100_000)  # a small method's own limit
        # the reply (72 MB) would be too large: building it takes seconds on a busy machine
        with RpcClient(srv.address, timeout=15) as c:
            with pytest.raises(KVPoolError, match="exceeds the message limit"):
                c.call("repeat", b"x" * 60_000, 1200)
            assert c.call("add", 1, 2) == 3


def test_raw_tcp_garbage_and_idle_connections(server, client):
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # says nothing
    half = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        half.sendall((100).to_bytes(4, "big") + b"only part")  # never finishes its frame
        for junk in [os.urandom(8192), b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 3]:
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                s.sendall(junk)
        assert client.call("echo", "still here") == "still here"
    finally:
        idle.close()
        half.close()


def test_a_client_that_never_reads_does_not_stall_others(server, client):
    """Requests whose replies are never read fill that connection only."""
    with raw_conn(server) as greedy:
        big = request("repeat", 1, [b"y" * 1024, 1024])  # 1 MiB replies
        greedy.settimeout(0.5)
        with contextlib.suppress(TimeoutError):
            for _ in range(64):
                greedy.sendall(big)
        assert client.call("echo", "not stalled") == "not stalled"


def test_dead_server_gives_connection_lost_then_reconnects():
    srv = RpcServer({"who": lambda: "first"}).start()
    port = srv.port
    c = RpcClient(srv.address, timeout=2.0)
    try:
        assert c.call("who") == "first"
        srv.close()
        t0 = time.monotonic()
        with pytest.raises(ConnectionLostError):
            c.call("who")
        assert time.monotonic() - t0 < 1.5  # refused at once, not a timeout
        with RpcServer({"who": lambda: "second"}, port=port) as again:
            assert again.port == port
            assert c.call("who") == "second"
    finally:
        c.close()


def test_concurrent_callers(client):
    results: dict[int, list] = {}

    def worker(tid: int) -> None:
        results[tid] = [client.call("add", tid * 1000, i) for i in range(50)]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {t: [t * 1000 + i for i in range(50)] for t in range(8)}


def test_asyncio_acall(client):
    async def main():
        got = await asyncio.gather(*(client.acall("add", i, b=1) for i in range(10)))
        with pytest.raises(NotFoundError):
            await client.acall("not_found", "k")
        return got

    assert asyncio.run(main()) == list(range(1, 11))


def test_retarget_and_close():
    with (
        RpcServer({"who": lambda: "a"}) as a,
        RpcServer({"who": lambda: "b"}) as b,
        RpcClient(a.address) as c,
    ):
        assert c.call("who") == "a"
        c.retarget(b.address)
        assert c.call("who") == "b"
        a.close()
        assert not a._thread.is_alive()
        c.close()
        with pytest.raises(KVPoolError, match="closed"):
            c.call("who")
    with pytest.raises(ValueError):
        RpcClient("no-port")


SERVER_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from kvpool.common.rpc import RpcServer
    with RpcServer({"pid": os.getpid, "mul": lambda a, b: a * b}) as srv:
        print(srv.port, flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin
    """
)


def test_server_in_another_process():
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "server process did not start"
        port = int(proc.stdout.readline())
        with RpcClient(f"127.0.0.1:{port}") as c:
            assert c.call("pid") == proc.pid != os.getpid()
            assert c.call("mul", b"ab", 3) == b"ababab"
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_meanwhile_runs_once_while_the_server_works():
    """``meanwhile`` runs after the request left and before its reply is read (the handler is
    seen running from inside it, and it lets the handler finish); work that raises propagates
    and the next call still gets its own reply; spinning changes nothing visible."""
    started, release = threading.Event(), threading.Event()

    def held(tag):
        started.set()
        assert release.wait(5), "the caller's meanwhile never ran"
        return tag

    for spin in (0.0, 0.002):
        with RpcServer({"held": held, "add": lambda a, b: a + b}) as srv, \
                RpcClient(srv.address, timeout=5.0, spin=spin) as c:  # fmt: skip
            started.clear()
            release.clear()
            seen: list[bool] = []

            def overlap(seen: list = seen) -> None:
                seen.append(started.wait(5))  # the server is inside the handler now
                release.set()

            assert c.call("held", "done", meanwhile=overlap) == "done"
            assert seen == [True]

            def boom() -> None:
                raise RuntimeError("caller's own failure")

            with pytest.raises(RuntimeError, match="caller's own"):
                c.call("add", 1, 2, meanwhile=boom)
            assert c.call("add", 3, 4) == 7  # the abandoned reply never answers a later call

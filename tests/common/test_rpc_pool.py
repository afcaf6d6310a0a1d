"""Reused RPC connections (``RpcPool``) against a real server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpool.common.errors import ConnectionLostError, NotFoundError
from kvpool.common.rpc import RpcServer, rpc_method
from kvpool.common.rpc_pool import RpcPool


class Handler:
    @rpc_method
    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @rpc_method
    def missing(self) -> None:
        raise NotFoundError("no such thing")


@pytest.fixture
def server():
    srv = RpcServer(Handler(), "127.0.0.1", 0, token="", workers=8).start()
    yield srv
    srv.close()


def test_sequential_calls_share_one_connection(server):
    pool = RpcPool(server.address, token="")
    assert [pool.call("slow", 0) for _ in range(20)] == ["done"] * 20
    assert pool.opened == 1
    with pytest.raises(NotFoundError):
        pool.call("missing")  # a typed error leaves the connection usable
    assert pool.call("slow", 0) == "done" and pool.opened == 1
    pool.close()


def test_concurrent_calls_get_their_own_connections_and_keep_them(server):
    pool = RpcPool(server.address, token="", max_idle=2)
    with ThreadPoolExecutor(4) as ex:
        assert list(ex.map(lambda _: pool.call("slow", 0.2), range(4))) == ["done"] * 4
    assert pool.opened == 4  # four at once: four connections...
    with ThreadPoolExecutor(2) as ex:
        assert list(ex.map(lambda _: pool.call("slow", 0.1), range(2))) == ["done"] * 2
    assert pool.opened == 4  # ...of which two stayed open for the next calls
    pool.close()


def test_a_restarted_server_is_reconnected(server):
    pool = RpcPool(server.address, token="")
    assert pool.call("slow", 0) == "done"
    host, port = server.address.rsplit(":", 1)
    server.close()
    again = RpcServer(Handler(), host, int(port), token="").start()
    try:
        # the stale connection may fail once (the server closed it), then it redials
        with contextlib.suppress(ConnectionLostError):
            pool.call("slow", 0)
        assert pool.call("slow", 0) == "done"
        assert pool.opened == 1  # the same client object, on a new socket
    finally:
        again.close()
        pool.close()

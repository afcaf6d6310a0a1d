"""The segment directory: in-process, HTTP metadata service, and a real etcd."""

from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest

from kvpool.common.errors import AlreadyExistsError, BadRequestError, KVPoolError
from kvpool.common.etcd import EtcdClient, prefix_end
from kvpool.transfer.metadata import (
    DescriptorTable,
    EtcdDirectory,
    HttpDirectory,
    InProcessDirectory,
    open_directory,
    wait_for,
)
from kvpool.transfer.metadata_server import MetadataServer
from kvpool.transfer.segment import SegmentDescriptor


def desc(name: str, owner: str = "o1", port: int = 1) -> SegmentDescriptor:
    return SegmentDescriptor(name, 4096, "127.0.0.1", port, 1, owner, 1, "boot", None)


def exercise(a, b) -> None:
    """Two directory clients (two owners) of the same backend."""
    a.publish(desc("s/1"))
    assert b.lookup("s/1") == desc("s/1")
    a.publish(desc("s/1", port=2))  # the owner may update its entry
    assert b.lookup("s/1").port == 2
    with pytest.raises(AlreadyExistsError):
        b.publish(desc("s/1", owner="o2"))
    b.publish(desc("s/2", owner="o2"))
    assert sorted(d.name for d in a.list() if d.name.startswith("s/")) == ["s/1", "s/2"]
    b.withdraw("s/1")  # not b's: nothing happens
    assert a.lookup("s/1") is not None
    a.close()  # withdraws a's entries only
    assert b.lookup("s/1") is None and b.lookup("s/2") is not None
    assert b.lookup("missing") is None
    b.close()
    assert b.lookup("s/2") is None


def test_in_process_directory():
    table = DescriptorTable()
    exercise(InProcessDirectory(table), InProcessDirectory(table))


def test_http_directory(metadata):
    exercise(HttpDirectory(metadata.url), HttpDirectory(metadata.url))


def test_etcd_directory(etcd):
    exercise(EtcdDirectory(etcd.endpoint), EtcdDirectory(etcd.endpoint))


def test_etcd_entries_die_with_their_owner_lease(etcd):
    owner = EtcdDirectory(etcd.endpoint, ttl=2)
    owner.publish(desc("lease/1"))
    other = EtcdDirectory(etcd.endpoint)
    time.sleep(3)  # the refresher keeps it alive past its ttl
    assert other.lookup("lease/1") is not None
    owner._stop.set()  # the owner stalls (as if killed): no more keep-alives
    deadline = time.monotonic() + 10
    while other.lookup("lease/1") is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert other.lookup("lease/1") is None


def test_etcd_client_basics(etcd):
    c = EtcdClient(["127.0.0.1:1", etcd.endpoint])  # the dead endpoint is skipped
    c.put(b"/t/a", b"1")
    c.put(b"/t/b", b"\x00\xff")
    assert c.get(b"/t/b") == b"\x00\xff"
    assert c.get_prefix(b"/t/") == [(b"/t/a", b"1"), (b"/t/b", b"\x00\xff")]
    assert c.create(b"/t/a", b"2") is False and c.get(b"/t/a") == b"1"
    assert c.create(b"/t/c", b"3") is True
    assert c.delete_prefix(b"/t/") == 3
    assert prefix_end(b"a\xff") == b"b" and prefix_end(b"\xff") == b"\0"
    with pytest.raises(KVPoolError, match="unreachable"):
        EtcdClient("127.0.0.1:1", timeout=0.5).get(b"x")


def test_engines_find_each_other_through_etcd(etcd, engine_factory):
    url = f"etcd://{etcd.endpoint}"
    owner = engine_factory(directory=url)
    seg = owner.register("etcd-peer/kv", size=8192)
    seg.array[:] = 9
    te = engine_factory(directory=url, transport="tcp")
    wait_for(te.directory, "etcd-peer/kv", 5)
    buf = np.zeros(100, np.uint8)
    te.read(buf, "etcd-peer/kv", 50)
    assert (buf == 9).all()


def test_http_service_validates_input_and_expires_entries(metadata):
    def call(method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(metadata.url + path, data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    code, body = call("PUT", "/v1/segments/x", {"name": "x"})
    assert code == 400 and "error" in body
    code, body = call("PUT", "/v1/segments/x", {**desc("x").to_dict(), "size": -5})
    assert code == 400 and "size" in body["error"]["message"]
    code, body = call("PUT", "/v1/segments/y", desc("x").to_dict())
    assert code == 400
    assert call("GET", "/v1/segments/nope")[0] == 404
    assert call("GET", "/nothing")[0] == 404
    assert call("DELETE", "/v1/segments/x?owner=o1")[0] == 404
    assert call("PUT", "/v1/segments/x", {**desc("x").to_dict(), "ttl": 0.3})[0] == 201
    assert call("GET", "/v1/segments/x")[0] == 200
    time.sleep(0.5)
    assert call("GET", "/v1/segments/x")[0] == 404  # not renewed: gone
    assert call("GET", "/health") == (200, {"status": "ok"})


def test_http_service_token():
    with MetadataServer(token="tok") as server:
        with pytest.raises(KVPoolError, match="401"):
            HttpDirectory(server.url).publish(desc("t"))
        ok = HttpDirectory(server.url, token="tok")
        ok.publish(desc("t"))
        assert ok.lookup("t") is not None
    with pytest.raises(ValueError):
        MetadataServer(host="0.0.0.0")


def test_open_directory_urls(metadata):
    assert isinstance(open_directory("memory"), InProcessDirectory)
    assert isinstance(open_directory(metadata.url), HttpDirectory)
    assert isinstance(open_directory("etcd://127.0.0.1:2379"), EtcdDirectory)
    with pytest.raises(BadRequestError):
        open_directory("zookeeper://x")
    with pytest.raises(KVPoolError, match="not published"):
        wait_for(open_directory("memory"), "never", timeout=0.2)

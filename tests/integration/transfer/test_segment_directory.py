"""The segment directory: in-process, HTTP metadata service, and a real etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from kvpool.common.errors import AlreadyExistsError, BadRequestError, KVPoolError
from kvpool.common.etcd import EtcdClient, prefix_end
from kvpool.common.net import host_matches
from kvpool.transfer.metadata import (
    OWNER_KEY_HEADER,
    DescriptorTable,
    EtcdDirectory,
    HttpDirectory,
    InProcessDirectory,
    open_directory,
    wait_for,
)
from kvpool.transfer.metadata_server import MetadataServer
from kvpool.transfer.segment import SegmentDescriptor, boot_id


def desc(name: str, owner: str = "o1", port: int = 1, pid: int | None = None,
         **fields) -> SegmentDescriptor:  # fmt: skip
    """A descriptor of a live owner on this host (this process) unless ``pid`` says else."""
    d = SegmentDescriptor(name, 4096, "127.0.0.1", port, 1, owner, pid or os.getpid(),
                          boot_id(), None)  # fmt: skip
    return SegmentDescriptor(**{**d.to_dict(), **fields})


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def exercise(a, b, keyed: bool = True) -> None:
    """Two directory clients (two owners) of the same backend (``keyed``: it checks owner
    keys, so knowing another's public owner id does not let one replace its entry)."""
    a.publish(desc("s/1"))
    assert b.lookup("s/1") == desc("s/1")
    a.publish(desc("s/1", port=2))  # the owner may update its entry
    assert b.lookup("s/1").port == 2
    with pytest.raises(AlreadyExistsError):
        b.publish(desc("s/1", owner="o2"))
    if keyed:
        with pytest.raises(AlreadyExistsError):
            b.publish(desc("s/1", owner="o1", port=666))  # a's id, not a's key
        assert a.lookup("s/1").port == 2
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


@pytest.fixture
def rpc_directory():
    """A directory served over RPC, as the store master serves it."""
    from kvpool.common.rpc import RpcServer
    from kvpool.transfer.directory_service import DirectoryService

    with RpcServer(DirectoryService(), token="") as srv:
        yield f"rpc://{srv.address}"


def test_rpc_directory(rpc_directory):
    exercise(open_directory(rpc_directory), open_directory(rpc_directory))
    d = open_directory(rpc_directory)
    with pytest.raises(BadRequestError, match="host"):
        d.publish(desc("far", host="10.99.1.2"))  # not the caller's address
    with pytest.raises(BadRequestError, match="shm_name"):
        d.publish(desc("evil", shm_name="../x"))
    d.close()


def test_etcd_directory(etcd):
    exercise(EtcdDirectory(etcd.endpoint), EtcdDirectory(etcd.endpoint), keyed=False)


@pytest.mark.parametrize("backend", ["memory", "rpc", "http", "etcd"])
def test_a_dead_owners_name_is_handed_over(backend, metadata, etcd, rpc_directory):
    table = DescriptorTable()
    make = {"memory": lambda: InProcessDirectory(table),
            "rpc": lambda: open_directory(rpc_directory),
            "http": lambda: HttpDirectory(metadata.url),
            "etcd": lambda: EtcdDirectory(etcd.endpoint)}[backend]  # fmt: skip
    a, b = make(), make()
    a.publish(desc(f"takeover/{backend}", owner="old", pid=dead_pid()))
    b.publish(desc(f"takeover/{backend}", owner="new"))  # a restarted worker takes it back
    assert a.lookup(f"takeover/{backend}").owner_id == "new"
    b.close()
    a.close()


def test_invalid_descriptors_in_etcd_are_not_used(etcd):
    c = EtcdClient(etcd.endpoint)
    bad = {**desc("evil").to_dict(), "shm_name": "../../home/user/.bashrc"}
    c.put(b"/kvpool/segments/evil", json.dumps(bad).encode())
    c.put(b"/kvpool/segments/junk", b"not json")
    d = EtcdDirectory(etcd.endpoint)
    with pytest.raises(BadRequestError, match="shm_name"):
        d.lookup("evil")
    assert "evil" not in [x.name for x in d.list()]
    c.delete_prefix(b"/kvpool/segments/")


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
    def call(method, path, body=None, key="k" * 32):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(metadata.url + path, data=data, method=method)
        if key:
            req.add_header(OWNER_KEY_HEADER, key)
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
    assert call("DELETE", "/v1/segments/x")[0] == 404
    for field, value in [("shm_name", "../../etc/passwd"), ("shm_name", "/etc/passwd"),
                         ("shm_name", "kvpool-1-abcdef01-x/../../y"), ("host", "10.99.1.2"),
                         ("host", "evil host"), ("segment_id", 2**40), ("owner_id", "")]:  # fmt: skip
        code, body = call("PUT", "/v1/segments/x", {**desc("x").to_dict(), field: value})
        assert code == 400 and field in body["error"]["message"], (field, value, body)
    assert call("PUT", "/v1/segments/x", desc("x").to_dict(), key=None)[0] == 400  # no key
    assert call("PUT", "/v1/segments/x", {**desc("x").to_dict(), "ttl": 0.3})[0] == 201
    assert call("GET", "/v1/segments/x")[0] == 200
    assert call("DELETE", "/v1/segments/x", key="z" * 32)[0] == 404  # another owner key
    assert call("GET", "/v1/segments/x")[0] == 200
    time.sleep(0.5)
    assert call("GET", "/v1/segments/x")[0] == 404  # not renewed: gone
    assert call("GET", "/health") == (200, {"status": "ok"})


def test_http_service_token():
    with MetadataServer(token="tok") as server:
        with pytest.raises(KVPoolError, match="401"):
            HttpDirectory(server.url, token="").publish(desc("t"))
        with pytest.raises(KVPoolError, match="401"):
            HttpDirectory(server.url, token="other").publish(desc("t"))
        ok = HttpDirectory(server.url, token="tok")
        ok.publish(desc("t"))
        assert ok.lookup("t") is not None
        req = urllib.request.Request(f"{server.url}/v1/segments",
                                     headers={"Authorization": "Bearer tok"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)  # the raw token is not the bearer
        assert info.value.code == 401
        ok.close()  # withdraws its entry and stops renewing it
    with pytest.raises(ValueError):
        MetadataServer(host="0.0.0.0")


def test_descriptor_hosts_must_be_the_publisher():
    assert host_matches("127.0.0.1", "127.0.0.1") and host_matches("localhost", "127.0.0.1")
    assert host_matches("10.0.0.5", "10.0.0.5")
    assert not host_matches("10.0.0.5", "10.0.0.6")  # another host's name
    assert not host_matches("10.99.1.2", "127.0.0.1")  # from loopback: our addresses only
    assert not host_matches("no-such-host.invalid", "127.0.0.1")


def test_open_directory_urls(metadata):
    assert isinstance(open_directory("memory"), InProcessDirectory)
    assert isinstance(open_directory(metadata.url), HttpDirectory)
    assert isinstance(open_directory("etcd://127.0.0.1:2379"), EtcdDirectory)
    with pytest.raises(BadRequestError):
        open_directory("zookeeper://x")
    with pytest.raises(KVPoolError, match="not published"):
        wait_for(open_directory("memory"), "never", timeout=0.2)

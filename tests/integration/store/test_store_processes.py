"""The pool as real processes: a master, storage nodes, and a client in the test process."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from support.procs import Proc

from kvpool.common.errors import BadRequestError, NotFoundError
from kvpool.config import TransferConfig
from kvpool.store import StoreClient
from kvpool.transfer.metadata_server import MetadataServer


@pytest.fixture
def cluster():
    """``cluster(replicas, nodes)`` -> (master, [nodes], client); everything stopped after."""
    procs: list[Proc] = []
    clients: list[StoreClient] = []
    meta = MetadataServer()

    def make(replicas: int = 1, nodes: int = 2, memory: str = "32MiB"):
        from support.ports import free_port

        port = free_port()
        master = Proc("store", "master", "--port", str(port), "--replicas", str(replicas),
                      "--node-ttl", "2")  # fmt: skip
        procs.append(master)
        addr = master.info["address"]
        members = []
        for i in range(nodes):
            node = Proc("store", "node", "--master", addr, "--memory", memory,
                        "--node-id", f"node{i}", "--directory", meta.url)  # fmt: skip
            procs.append(node)
            members.append(node)
        client = StoreClient(addr, TransferConfig(directory=meta.url))
        clients.append(client)
        return master, members, client

    yield make
    for c in clients:
        c.close()
    for p in reversed(procs):
        p.stop()
    meta.close()


def test_put_get_across_processes(cluster):
    _, _, client = cluster(replicas=1, nodes=2)
    values = {f"k{i}": os.urandom(1000 + i * 50_000) for i in range(20)}
    for k, v in values.items():
        client.put(k, v)
    for k, v in values.items():
        assert client.get(k) == v
    stats = client.stats()
    assert stats["nodes"] == 2 and stats["objects"] == 20


def test_node_killed_with_two_replicas_every_object_stays_readable(cluster):
    _, nodes, client = cluster(replicas=2, nodes=2)
    values = {f"r{i}": os.urandom(200_000) for i in range(10)}
    for k, v in values.items():
        client.put(k, v)
    nodes[0].stop(signal.SIGKILL)
    for k, v in values.items():
        assert client.get(k) == v  # the surviving replica answers
    time.sleep(3)  # past the node TTL: the master drops the dead node's replicas
    assert client.stats()["nodes"] == 1
    for k, v in values.items():
        assert client.get(k) == v


def test_node_killed_with_one_replica_gives_clean_misses(cluster):
    _, nodes, client = cluster(replicas=1, nodes=2)
    values = {f"s{i}": os.urandom(100_000) for i in range(12)}
    for k, v in values.items():
        client.put(k, v)
    nodes[1].stop(signal.SIGKILL)
    time.sleep(3)
    hits = misses = 0
    for k, v in values.items():
        try:
            assert client.get(k) == v  # never other bytes
            hits += 1
        except NotFoundError:
            misses += 1
    assert hits > 0 and misses > 0 and hits + misses == 12
    client.put("after", b"still works")
    assert client.get("after") == b"still works"


def test_master_and_node_stop_cleanly_without_shm_leftovers(cluster):
    master, nodes, client = cluster(replicas=1, nodes=1)
    client.put("x", b"y")
    pid = nodes[0].proc.pid
    assert nodes[0].stop(signal.SIGINT) == 0
    assert master.stop(signal.SIGTERM) == 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvpool-{pid}-")]


def test_metrics_and_health_endpoints():
    import urllib.request

    from support.ports import free_port

    meta = MetadataServer()
    mport, nport = free_port(), free_port()
    master = Proc("store", "master", "--port", str(free_port()), "--metrics-port", str(mport))
    node = Proc("store", "node", "--master", master.info["address"], "--memory", "16MiB",
                "--node-id", "m-node", "--directory", meta.url, "--metrics-port", str(nport))  # fmt: skip
    client = StoreClient(master.info["address"], TransferConfig(directory=meta.url))
    try:
        client.put("m1", b"x" * 5000)
        client.get("m1")
        with pytest.raises(NotFoundError):
            client.get("m2")

        def fetch(port: int, path: str) -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.read().decode()

        text = fetch(mport, "/metrics")
        assert "kvpool_store_objects 1.0" in text
        assert 'kvpool_store_capacity_bytes{tier="dram"} 1.6777216e+07' in text
        assert "kvpool_store_hits_total 1.0" in text and "kvpool_store_misses_total 1.0" in text
        assert json.loads(fetch(mport, "/health"))["status"] == "ok"
        assert "kvpool_rpc_latency_seconds_count" in text and "kvpool_rpc_calls_total" in text
        time.sleep(1.5)  # the node's index follows with its heartbeat
        node_text = fetch(nport, "/metrics")
        assert "kvpool_store_node_objects 1.0" in node_text
        assert "kvpool_transfer_served_bytes_total" in node_text
        assert json.loads(fetch(nport, "/health"))["objects"] == 1
    finally:
        client.close()
        node.stop()
        master.stop()
        meta.close()


def test_garbage_rpc_frames_never_crash_the_master(cluster):
    import socket

    master, _, client = cluster(replicas=1, nodes=1)
    host, port = master.info["address"].rsplit(":", 1)
    for junk in (b"", b"\xff" * 100, b"\x00\x00\x00\x03\x93\x01\x02", os.urandom(5000)):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(junk)
    from kvpool.common.rpc import RpcClient

    with RpcClient(master.info["address"], timeout=5) as rpc:
        with pytest.raises(BadRequestError, match="unknown method"):
            rpc.call("no_such_method")
        with pytest.raises(BadRequestError, match="size must be an integer"):
            rpc.call("put_start", "k", "not a size")
        with pytest.raises(BadRequestError, match="key"):
            rpc.call("put_start", 12, 100)
    client.put("still-alive", b"ok")  # the master still serves
    assert client.get("still-alive") == b"ok"
    assert master.proc.poll() is None

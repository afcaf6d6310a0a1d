"""Master fail-over through a real etcd: two masters, one leads; kill it, the other serves."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.procs import Proc

from kvpool.common.errors import NotFoundError
from kvpool.common.etcd import EtcdClient
from kvpool.config import TransferConfig
from kvpool.store import StoreClient
from kvpool.store.master.ha import LEADER_KEY, leader_address
from kvpool.transfer.metadata_server import MetadataServer


def test_leader_killed_standby_takes_over(etcd):
    from support.ports import free_port

    etcd_client = EtcdClient(etcd.endpoint)
    etcd_client.delete(LEADER_KEY)
    meta = MetadataServer()
    procs = []
    try:
        for _ in range(2):
            procs.append(Proc("store", "master", "--port", str(free_port()), "--etcd",
                              etcd.endpoint, "--leader-ttl", "2", "--node-ttl", "30"))  # fmt: skip
        url = f"etcd://{etcd.endpoint}"
        procs.append(Proc("store", "node", "--master", url, "--memory", "32MiB",
                          "--node-id", "ha-node", "--directory", meta.url))  # fmt: skip
        client = StoreClient(url, TransferConfig(directory=meta.url))
        values = {f"ha{i}": os.urandom(50_000) for i in range(10)}
        for k, v in values.items():
            client.put(k, v)
        # killed right after the last ack: with --etcd a put is acknowledged once its node
        # holds its index entry (what the standby rebuilds from), so nothing acked is lost
        leader = leader_address(etcd_client)
        victim = next(p for p in procs[:2] if p.info["address"] == leader)
        victim.stop(signal.SIGKILL)
        t0 = time.monotonic()
        client.put("after-failover", b"new leader")  # rides through the election
        served_after = time.monotonic() - t0
        assert served_after < 5.0, f"new leader served after {served_after:.1f} s"
        assert leader_address(etcd_client) != leader
        deadline = time.monotonic() + 10  # the node mounts again and reports its objects
        while not client.exists("ha9") and time.monotonic() < deadline:
            time.sleep(0.2)
        for k, v in values.items():
            assert client.get(k) == v
        assert client.get("after-failover") == b"new leader"
        with pytest.raises(NotFoundError):  # a real miss, once the rebuild grace is over
            client.get("never-put")
        client.close()
    finally:
        for p in reversed(procs):
            p.stop()
        meta.close()

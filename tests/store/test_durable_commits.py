"""Durable commits (``kvpool store master --etcd``, ``commit_wait``): a put is acknowledged
once the nodes of its replicas hold its index entry, which is what a standby master rebuilds
its table from; and index deltas pushed by the master and fetched by heartbeats may cross."""

from __future__ import annotations

import pytest

from kvpool.common.errors import BadRequestError
from kvpool.common.rpc import RpcClient
from kvpool.config import TransferConfig
from kvpool.store import StoreClient
from kvpool.store.master.service import MasterService
from kvpool.store.node import StorageNode


@pytest.fixture
def pool(request):
    service = MasterService(commit_wait=request.param)
    server = service.serve()
    # heartbeats once a minute: only the master's pushes can deliver index entries in time
    node = StorageNode("dur-node", server.address, 16 << 20, TransferConfig(),
                       heartbeat_interval=60.0)  # fmt: skip
    client = StoreClient(server.address, TransferConfig())
    yield service, node, client
    client.close()
    node.close()
    server.close()
    service.close()


@pytest.mark.parametrize("pool", [2.0], indirect=True)
def test_an_acknowledged_put_is_in_its_nodes_index(pool):
    service, node, client = pool
    for i in range(40):
        client.put(f"d{i}", bytes([i]) * 1000)
        with node._lock:
            assert f"d{i}" in node.index, f"put {i} acknowledged before its node knew it"
    keys = [f"b{i}" for i in range(20)]
    client.batch_put(keys, [b"v" * 100] * 20)
    with node._lock:
        assert all(k in node.index for k in keys)
    client.remove("d0")
    assert service.stats()["unconfirmed_commits"] == 0


@pytest.mark.parametrize("pool", [0.0], indirect=True)
def test_without_commit_wait_the_push_follows_soon(pool):
    import time

    _, node, client = pool
    client.put("soon", b"x" * 100)
    deadline = time.monotonic() + 2
    while "soon" not in node.index and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "soon" in node.index  # pushed in milliseconds, not at the next heartbeat (60 s)


@pytest.mark.parametrize("pool", [2.0], indirect=True)
def test_a_stale_delta_batch_does_not_resurrect_a_removed_object(pool):
    _, node, _ = pool
    node._apply("other-epoch", 3, [["add", "a", 1, "s", 0, None], ["add", "b", 1, "s", 8, None],
                                   ["del", "a", 0, "s", 0, None]])  # fmt: skip
    node._apply("other-epoch", 2, [["add", "a", 1, "s", 0, None], ["add", "b", 1, "s", 8, None]])
    assert "a" not in node.index and "b" in node.index
    node._apply("other-epoch", 4, [["del", "a", 0, "s", 0, None], ["add", "c", 1, "s", 16, None]])
    assert "c" in node.index and "a" not in node.index


@pytest.mark.parametrize("pool", [2.0], indirect=True)
def test_malformed_delta_pushes_are_refused(pool):
    _, node, _ = pool
    with RpcClient(node.rpc.address, timeout=5) as c:
        for args in (("e", "1", []), ("e", 1, "x"), ("e", 1, [["add", "k"]]),
                     ("e", 1, [["boom", "k", 1, "s", 0, None]])):  # fmt: skip
            with pytest.raises(BadRequestError):
                c.call("deltas", *args)


def test_node_indexes_match_the_master_through_evictions_removes_and_upserts():
    """What each node's index says it holds (what a new master rebuilds from) is exactly the
    master's table, after a load that evicts, removes, upserts and reports a node unreachable.
    Found by the master-kill drill: an evicted object stayed in its node's index, and the
    master elected next adopted it over the bytes of puts acknowledged since."""
    import os
    import random
    import time

    from kvpool.config import MasterConfig

    service = MasterService(MasterConfig(lease_ttl=0.2), commit_wait=2.0)
    server = service.serve()
    nodes = [StorageNode(f"ix{i}", server.address, 4 << 20, TransferConfig()) for i in (1, 2)]
    client = StoreClient(server.address, TransferConfig())
    rng = random.Random(7)
    try:
        for i in range(120):
            keys = [f"k{i}-{j}" for j in range(4)]
            client.batch_put(keys, [os.urandom(rng.choice([20_000, 70_000])) for _ in keys])
            if i % 10 == 3:
                client.remove(keys[0])
            if i % 10 == 5:
                client.upsert(keys[1], b"u" * 3000)
            if i % 25 == 7:
                client._report_unreachable(["ix1"])
        assert service.stats()["evictions"] > 50  # the load did evict
        time.sleep(1.2)  # the replicas freed after their leases, and a heartbeat
        with service.lock:
            want = {n.node_id: {} for n in nodes}
            for key, meta in service.state.objects.items():
                for r in meta.replicas:
                    want[r.node_id][key] = (r.segment, r.offset)
        for n in nodes:
            with n._lock:
                have = {k: v[:2] for k, v in n.index.items()}
            assert have == want[n.node_id], (
                f"{n.node_id}: stale {len(set(have) - set(want[n.node_id]))}, "
                f"missing {len(set(want[n.node_id]) - set(have))}")  # fmt: skip
    finally:
        client.close()
        for n in nodes:
            n.close()
        server.close()
        service.close()


def test_a_node_that_does_not_confirm_stalls_one_put_not_all():
    """A node that stops answering pushes (hung, not dead): the first put waits commit_wait,
    is acknowledged anyway and counted; later puts do not wait for that node again until it
    confirms."""
    import time

    service = MasterService(commit_wait=0.5)
    server = service.serve()
    node = StorageNode("hung", server.address, 16 << 20, TransferConfig(), heartbeat_interval=60.0)
    client = StoreClient(server.address, TransferConfig())
    try:
        node.rpc.close()  # pushes to it now fail; its heartbeats (every 60 s) are far away
        t0 = time.monotonic()
        client.put("first", b"1" * 100)
        first = time.monotonic() - t0
        t0 = time.monotonic()
        for i in range(5):
            client.put(f"next{i}", b"2" * 100)
        rest = time.monotonic() - t0
        assert 0.4 < first < 3 and rest < 0.5, (first, rest)
        assert service.stats()["unconfirmed_commits"] == 1
        node.beat()  # it catches up: a heartbeat delivers every delta,
        node.beat()  # the next acknowledges them: it is waited for again
        assert "next4" in node.index and service.commits.unconfirmed == set()
    finally:
        client.close()
        node.close()
        server.close()
        service.close()

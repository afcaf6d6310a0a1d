"""Nodes and clients that come and go, with real `kvpool store` processes: nothing acknowledged
is lost, nothing unreadable is reported as there, and no wait is unbounded."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from support.procs import Proc

from kvpool.common.errors import NotFoundError, PutInProgressError
from kvpool.common.rpc import RpcClient
from kvpool.config import TransferConfig
from kvpool.integrations.mooncake import MooncakeDistributedStore
from kvpool.store import StoreClient

MiB = 1 << 20
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}


@pytest.fixture
def master():
    m = Proc("store", "master", "--port", "0", "--log-level", "warning", "--node-ttl", "30",
             env=ENV)  # fmt: skip
    yield m.info["address"]
    m.stop()


def node(master: str, node_id: str | None = None, memory: str = "32MiB") -> Proc:
    args = ["store", "node", "--master", master, "--memory", memory, "--log-level", "warning"]
    return Proc(*args, *(["--node-id", node_id] if node_id else []), env=ENV)


def stats(master: str) -> dict:
    with RpcClient(master) as c:
        return c.call("stats")


def value(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(n)


P2P_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    from kvpool.integrations.mooncake import MooncakeDistributedStore
    master = sys.argv[1]
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
    out = {}
    for i, n in enumerate([1, 4096, 65_537, 1 << 20, 4 << 20]):
        v = np.random.default_rng(i).bytes(n)
        out[f"p2p/{i}"] = [s.put(f"p2p/{i}", v), s.get(f"p2p/{i}") == v, s.is_exist(f"p2p/{i}")]
    s.close()
    print(json.dumps(out))
    """
)


def test_p2p_handshake_across_processes_needs_only_master_and_node(master):
    """Mooncake's own set-up (``P2PHANDSHAKE``) in a separate process, against nothing but
    ``kvpool store master`` and ``kvpool store node``: the master is the directory."""
    n = node(master)
    try:
        out = subprocess.run([sys.executable, "-c", P2P_SCRIPT, master], capture_output=True,
                             text=True, timeout=120, env=ENV)  # fmt: skip
        assert out.returncode == 0, out.stderr
        results = json.loads(out.stdout.strip().splitlines()[-1])
        assert all(r == [0, True, 1] for r in results.values()), results
        here = MooncakeDistributedStore()  # and this process reads what that one put
        assert here.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
        assert here.get("p2p/3") == value(1 << 20, 3)
        here.close()
    finally:
        n.stop()


def test_a_failed_put_leaves_nothing_behind(master):
    n = node(master)
    try:
        lost = StoreClient(master, TransferConfig(directory="memory"))  # cannot find the node
        with pytest.raises(NotFoundError):
            lost.put("k", b"x" * 100)
        assert lost.batch_put(["k2", "k3"], [b"y", b"z"])[0] is not None
        lost.close()
        assert stats(master)["objects"] == 0  # revoked at once, not left to time out
        with StoreClient(master) as good:
            good.put("k", b"real")  # not "in progress", not "already exists"
            assert good.get("k") == b"real"
            good.batch_put(["k2", "k3"], [b"y", b"z"])
            assert good.batch_get(["k2", "k3"]) == [b"y", b"z"]
    finally:
        n.stop()


def test_a_put_in_progress_is_not_already_there(master):
    n = node(master)
    try:
        with RpcClient(master) as raw, StoreClient(master) as c:
            start = raw.call("put_start", "slow", 100)
            with pytest.raises(PutInProgressError):
                c.put("slow", b"other")
            mc = MooncakeDistributedStore()
            assert mc.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
            assert mc.put("slow", b"other") == -703  # REPLICA_IS_NOT_READY, never 0
            mc.close()
            raw.call("put_revoke", "slow", start["put_id"])
            c.put("slow", b"now")
            assert c.get("slow") == b"now"
    finally:
        n.stop()


def test_a_node_that_closes_takes_its_objects_at_once(master):
    keep, leave = node(master, "keep", "64MiB"), node(master, "leave", "64MiB")
    try:
        with StoreClient(master) as c:
            values = {f"k{i}": value(MiB, i) for i in range(16)}
            for k, v in values.items():
                c.put(k, v)
            with RpcClient(master) as raw:
                on = {k: raw.call("get", k)["replicas"][0]["node"] for k in values}
            assert set(on.values()) == {"keep", "leave"}, on  # most free space first: both nodes
            leave.stop()  # SIGTERM: it unmounts before it exits
            assert stats(master)["nodes"] == 1
            c.leases.clear()
            for k, v in values.items():
                if on[k] == "keep":
                    assert c.get(k) == v
                else:  # a clean miss at once, and the key can be put again for real
                    assert not c.exists(k)
                    with pytest.raises(NotFoundError):
                        c.get(k)
                    c.put(k, b"again")
                    assert c.get(k) == b"again"
    finally:
        keep.stop()
        leave.stop()


def test_a_node_back_under_the_same_id_starts_clean(master):
    first = node(master, "phoenix")
    with StoreClient(master) as c:
        c.put("old", b"from the first life")
        first.stop(signal.SIGKILL)  # no unmount: the master still lists it
        assert c.exists("old")
        again = node(master, "phoenix")  # a new process under the same id, within node_ttl
        try:
            assert stats(master)["objects"] == 0 and not c.exists("old")
            c.leases.clear()
            with pytest.raises(NotFoundError):
                c.get("old")
            c.put("old", b"second life")  # a real put, not "keeps the first value"
            assert c.get("old") == b"second life"
        finally:
            again.stop()


def test_a_key_on_a_silent_node_is_put_again(master):
    silent, alive = node(master, "silent", "128MiB"), node(master, "alive", "64MiB")
    try:
        with StoreClient(master) as c:
            c.put("k", b"on the silent node")
            os.kill(silent.proc.pid, signal.SIGSTOP)  # alive, but it stops answering
            time.sleep(3.5)  # past node_suspect_after (3 missed heartbeats)
            c.put("k", b"on a live node")  # its replicas are unreachable: a real put
            c.leases.clear()
            assert c.get("k") == b"on a live node"
    finally:
        os.kill(silent.proc.pid, signal.SIGCONT)
        silent.stop()
        alive.stop()


def test_many_threads_after_close_and_setup_never_hang(master):
    n = node(master, memory="256MiB")
    try:
        store = MooncakeDistributedStore()
        for _ in range(2):  # the second life of the same object, with its own segment
            assert store.setup("127.0.0.1", "P2PHANDSHAKE", 32 * MiB, 16 * MiB, "tcp", "",
                               master) == 0  # fmt: skip
            assert store.put("shared", b"v" * 100) == 0
            assert store.get("shared") == b"v" * 100
            store.close()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 32 * MiB, 16 * MiB, "tcp", "",
                           master) == 0  # fmt: skip

        def load(t: int) -> int:
            bad = 0
            for i in range(10):
                v = value(MiB, 1000 * t + i)
                bad += store.put(f"t{t}/{i}", v) != 0 or store.get(f"t{t}/{i}") != v
            return bad

        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(8) as pool:
            bad = sum(pool.map(load, range(8)))
        assert bad == 0
        assert time.monotonic() - t0 < 60  # alone this takes a few seconds
        store.close()
    finally:
        n.stop()

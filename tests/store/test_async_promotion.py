"""Tier moves never make the master wait for a node: the copy runs on the master's mover
thread and is applied when it ends. A get is served from SSD while its promotion runs; a put
that needs the DRAM an offload frees waits for it with the master's lock released."""

from __future__ import annotations

import os
import threading
import time

import pytest
from fake_clock import Clock

from kvpool.common.errors import RoomPendingError
from kvpool.common.rpc import RpcClient, RpcServer, rpc_method
from kvpool.config import MasterConfig
from kvpool.store.master.objects import Tier
from kvpool.store.master.service import MasterService
from kvpool.store.master.state import MasterState
from kvpool.store.master.view import MovesPending

KiB = 1024


class LaterMover:
    """Holds started copies until the test finishes them (``done`` as the service would);
    ``hold_offloads`` False: copies to SSD end at once."""

    def __init__(self, hold_offloads: bool = False) -> None:
        self.pending: list = []
        self.hold_offloads = hold_offloads

    def __call__(self, src, dst, size, done) -> None:
        if dst.tier is Tier.SSD and not self.hold_offloads:
            done(True)
            return
        self.pending.append((src, dst, done))


def ssd_only(s: MasterState, clock: Clock, key: str, size: int):
    """An object that lives on SSD only (put, then offloaded by a put that needs the DRAM)."""
    meta = s.put_start(key, size)
    s.put_end(key, meta.put_id, 0)
    clock.t += 10
    for i in range(4):  # fill DRAM: ``key`` is the coldest and goes to SSD
        m = s.put_start(f"fill{i}-{key}", size)
        s.put_end(m.key, m.put_id, 0)
        clock.t += 10
    assert s.objects[key].replicas[0].tier is Tier.SSD
    for k in [k for k in s.objects if k.startswith("fill")]:
        s.remove(k, force=True)


@pytest.fixture
def state():
    clock = Clock()
    s = MasterState(MasterConfig(high_watermark=0.95, low_watermark=0.5, lease_ttl=1,
                                 cooldown=1), clock=clock)  # fmt: skip
    s.mover = lambda src, dst, size: True  # offloads copy at once (not what is tested here)
    s.mount("n1", "n1/dram", Tier.DRAM, 100 * KiB)
    s.mount("n1", "n1/ssd", Tier.SSD, 300 * KiB)
    s.mover_async = later = LaterMover()
    return s, clock, later


def test_a_get_starts_the_promotion_and_is_served_from_ssd(state):
    s, clock, later = state
    ssd_only(s, clock, "k", 30 * KiB)
    used = s.usage(Tier.DRAM)[0]
    assert s.get("k").replicas[0].tier is Tier.SSD  # not waiting for the copy
    [(_src, dst, done)] = later.pending
    assert s.usage(Tier.DRAM)[0] == used + 30 * KiB  # the DRAM range is reserved meanwhile
    assert s.get("k").replicas[0].tier is Tier.SSD and len(later.pending) == 1  # not twice
    done(True)
    assert s.objects["k"].replicas == [dst] and s.counters["promotions"] == 1
    # the lease of those gets still covers the SSD copy: it goes when the lease ends
    assert s.usage(Tier.SSD)[0] == 30 * KiB
    clock.t += 2
    s.tick()
    assert s.usage(Tier.SSD)[0] == 0


def test_an_object_removed_during_its_promotion_gives_the_range_back(state):
    s, clock, later = state
    ssd_only(s, clock, "k", 30 * KiB)
    s.get("k")
    clock.t += 2
    s.remove("k")
    later.pending[0][2](True)
    assert "k" not in s.objects and s.usage(Tier.DRAM)[0] == 0 and s.usage(Tier.SSD)[0] == 0


def held_offloads_full(state):
    """Three 30 KiB objects in the 100 KiB DRAM, copies to SSD held: (state, mover)."""
    s, clock, later = state
    later.hold_offloads = True
    for i in range(3):
        m = s.put_start(f"k{i}", 30 * KiB)
        s.put_end(m.key, m.put_id, 0)
        clock.t += 10
    return s, later


def test_a_put_waits_for_the_offload_that_frees_its_dram(state):
    s, later = held_offloads_full(state)
    with pytest.raises(MovesPending):  # 90 of 100 KiB: k0, k1 start moving (low mark 50)
        s.put_start("k3", 30 * KiB)
    assert s.objects["k0"].replicas[0].tier is Tier.DRAM  # readable where it was meanwhile
    assert [src.segment for src, _, _ in later.pending] == ["n1/dram", "n1/dram"]
    for _, _, done in later.pending:
        done(True)
    assert [s.objects[k].replicas[0].tier for k in ("k0", "k1", "k2")] == [Tier.SSD, Tier.SSD,
                                                                           Tier.DRAM]  # fmt: skip
    assert s.counters["offloads"] == 2
    m = s.put_start("k3", 30 * KiB)  # the room is there now
    assert m.replicas[0].tier is Tier.DRAM
    assert s.counters["evictions"] == 0  # nothing was dropped


def test_a_failed_offload_keeps_the_object_and_a_last_try_drops(state):
    s, later = held_offloads_full(state)
    with pytest.raises(MovesPending):
        s.put_start("k3", 30 * KiB)
    for _, _, done in later.pending:
        done(False)  # the node could not copy them
    assert s.objects["k0"].replicas[0].tier is Tier.DRAM and s.usage(Tier.SSD)[0] == 0
    s.drop_evicts = True  # what the service's last attempt does
    m = s.put_start("k3", 30 * KiB)
    s.drop_evicts = False
    assert m.replicas and s.counters["evictions"] >= 1


def test_a_failed_copy_leaves_the_object_on_ssd(state):
    s, clock, later = state
    ssd_only(s, clock, "k", 30 * KiB)
    s.get("k")
    later.pending[0][2](False)
    assert s.objects["k"].replicas[0].tier is Tier.SSD and s.usage(Tier.DRAM)[0] == 0


class SlowNode:
    """A node's ``copy`` RPC that blocks until the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.release.set()
        self.copies = 0

    @rpc_method
    def copy(self, src_seg, src_off, dst_seg, dst_off, size) -> bool:
        self.copies += 1
        return self.release.wait(20)

    @rpc_method
    def deltas(self, epoch, seq, entries) -> bool:  # the master's index pushes: taken
        return True


def put_retrying(c: RpcClient, key: str, size: int) -> None:
    """What ``StoreClient.put`` does with a master: ask again while offloads make room."""
    deadline = time.monotonic() + 10
    while True:
        try:
            meta = c.call("put_start", key, size)
            break
        except RoomPendingError:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    c.call("put_end", key, meta["put_id"], 0)


def test_a_hung_promotion_stalls_nobody():
    node = SlowNode()
    service = MasterService(MasterConfig(high_watermark=0.95, low_watermark=0.5, lease_ttl=0.2,
                                         cooldown=0))  # fmt: skip
    with RpcServer(node, "127.0.0.1", 0, token="").start() as node_srv, \
            service.serve(token="") as srv, RpcClient(srv.address, token="") as c:  # fmt: skip
        c.call("mount", "n1", "n1/dram", "dram", 100 * KiB, node_srv.address)
        c.call("mount", "n1", "n1/ssd", "ssd", 300 * KiB, node_srv.address)
        for i in range(5):  # the fourth and fifth push the oldest to SSD (offloads: copies)
            put_retrying(c, f"k{i}", 30 * KiB)
            time.sleep(0.05)
        ssd = [k for k in (f"k{i}" for i in range(5))
               if c.call("get", k)["replicas"][0]["tier"] == "ssd"]  # fmt: skip
        assert ssd, "nothing was offloaded"
        time.sleep(0.3)  # the leases of those gets are over
        for k in (f"k{i}" for i in range(5)):
            if k not in ssd:
                c.call("remove", k)
        node.release.clear()  # from now on the node's copies hang
        time.sleep(0.3)  # the leases of those gets are over
        t0 = time.perf_counter()
        assert c.call("get", ssd[0])["replicas"][0]["tier"] == "ssd"  # starts the promotion
        others = [c.call("heartbeat", "n1")["known"], c.call("exists", ssd[0]),
                  c.call("stats")["objects"]]  # fmt: skip
        assert time.perf_counter() - t0 < 2.0, "the master waited for the node"
        assert others[0] is True and others[1] is True and others[2] >= 1
        deadline = time.monotonic() + 5
        while node.copies < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the promotion's copy has reached the node and hangs there
        assert node.copies >= 3
        node.release.set()
        deadline = time.monotonic() + 10
        while c.call("get", ssd[0])["replicas"][0]["tier"] != "dram":
            assert time.monotonic() < deadline, "the promotion was never applied"
            time.sleep(0.05)
    service.close()


def test_without_an_async_mover_a_get_promotes_at_once():
    """The state's sync path (no ``mover_async``) still promotes at once (pure tests)."""
    clock = Clock()
    s = MasterState(MasterConfig(high_watermark=0.95, low_watermark=0.5, lease_ttl=1,
                                 cooldown=1), clock=clock)  # fmt: skip
    mem = {"n1/dram": bytearray(100 * KiB), "n1/ssd": bytearray(300 * KiB)}

    def copy(src, dst, size):
        mem[dst.segment][dst.offset : dst.offset + size] = mem[src.segment][
            src.offset : src.offset + size]  # fmt: skip
        return True

    s.mover = copy
    s.mount("n1", "n1/dram", Tier.DRAM, 100 * KiB)
    s.mount("n1", "n1/ssd", Tier.SSD, 300 * KiB)
    value = os.urandom(30 * KiB)
    meta = s.put_start("k", len(value))
    r = meta.replicas[0]
    mem[r.segment][r.offset : r.offset + len(value)] = value
    s.put_end("k", meta.put_id, 0)
    clock.t += 10
    for i in range(4):
        m = s.put_start(f"f{i}", 30 * KiB)
        s.put_end(m.key, m.put_id, 0)
        clock.t += 10
    for i in range(4):
        s.remove(f"f{i}", force=True)
    got = s.get("k").replicas[0]
    assert got.tier is Tier.DRAM  # promoted within the get
    assert bytes(mem[got.segment][got.offset : got.offset + len(value)]) == value


def test_a_put_waiting_for_a_hung_offload_blocks_nobody():
    node = SlowNode()
    node.release.clear()  # every copy hangs
    service = MasterService(MasterConfig(high_watermark=0.95, low_watermark=0.5, lease_ttl=0.1,
                                         cooldown=0), move_wait=0.5)  # fmt: skip
    with RpcServer(node, "127.0.0.1", 0, token="").start() as node_srv, \
            service.serve(token="") as srv, RpcClient(srv.address, token="") as c:  # fmt: skip
        c.call("mount", "n1", "n1/dram", "dram", 100 * KiB, node_srv.address)
        c.call("mount", "n1", "n1/ssd", "ssd", 300 * KiB, node_srv.address)
        for i in range(3):
            meta = c.call("put_start", f"k{i}", 30 * KiB)
            c.call("put_end", f"k{i}", meta["put_id"], 0)
        time.sleep(0.2)  # no leases left
        t0 = time.perf_counter()
        with pytest.raises(RoomPendingError):  # offloads started; they hang on the node
            c.call("put_start", "k3", 30 * KiB)
        assert c.call("heartbeat", "n1")["known"] is True and c.call("exists", "k2") is True
        assert time.perf_counter() - t0 < 0.5, "the master waited for the node"
        batch = c.call("batch_put_start", [["k4", 30 * KiB]])
        assert batch[0]["error"]["type"] == "RoomPendingError"
        time.sleep(0.6)  # past move_wait: the next try drops the coldest instead
        meta = c.call("put_start", "k3", 30 * KiB)
        assert meta["replicas"] and c.call("stats")["evictions"] >= 1
        node.release.set()
    service.close()


def test_store_client_puts_ride_through_offloads(tmp_path):
    """A real pool with an SSD tier (its node copies for real): puts that need room wait for
    the offloads, by retrying; every value reads back byte for byte."""
    from kvpool.store.embedded import EmbeddedStore

    cfg = MasterConfig(high_watermark=0.9, low_watermark=0.6, cooldown=0.2, lease_ttl=0.2)
    values = {f"v{i}": os.urandom(256 * KiB) for i in range(48)}  # 12 MiB through 4 MiB DRAM
    with EmbeddedStore("4MiB", cfg, ssd_path=str(tmp_path / "ssd"), ssd_size="64MiB") as store:
        for k, v in values.items():
            store.put(k, v)
        stats = store.stats()
        assert stats["offloads"] > 0
        assert all(store.get(k) == v for k, v in values.items())

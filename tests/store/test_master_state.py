"""The master's rules, exactly, with a hand-driven clock."""

from __future__ import annotations

import pytest
from fake_clock import Clock

from kvpool.common.errors import (
    AlreadyExistsError,
    BackpressureError,
    BadRequestError,
    LeaseExpiredError,
    NoSpaceError,
    NotFoundError,
    PutInProgressError,
)
from kvpool.config import MasterConfig
from kvpool.store.master.objects import ObjectState, Replica, Tier
from kvpool.store.master.state import MasterState

KiB = 1024


@pytest.fixture
def clock():
    return Clock()


def make(clock, nodes=("n1",), capacity=100 * KiB, **cfg) -> MasterState:
    state = MasterState(MasterConfig(**cfg), clock=clock)
    for node in nodes:
        state.mount(node, f"{node}/dram", Tier.DRAM, capacity)
    return state


def put(state: MasterState, key: str, size: int, **kw) -> None:
    meta = state.put_start(key, size, **kw)
    state.put_end(key, meta.put_id, 0)


def test_two_phase_put_is_invisible_until_it_ends(clock):
    s = make(clock)
    meta = s.put_start("k", 1000)
    assert meta.state is ObjectState.PROCESSING and len(meta.replicas) == 1
    assert not s.exists("k")
    with pytest.raises(NotFoundError):
        s.get("k")
    with pytest.raises(PutInProgressError):
        s.put_start("k", 1000)  # in flight: not "already exists" (nothing readable yet)
    with pytest.raises(NotFoundError):
        s.put_end("k", meta.put_id + 1, 42)  # another put id: not this client's put
    with pytest.raises(BadRequestError):
        s.put_end("k", meta.put_id, None)  # a checksum is required
    with pytest.raises(BadRequestError):
        s.put_end("k", meta.put_id, 1 << 64)
    assert not s.exists("k")
    s.put_end("k", meta.put_id, 42)
    assert s.exists("k") and s.get("k").checksum == 42
    with pytest.raises(AlreadyExistsError):
        s.put_start("k", 10)  # immutable
    with pytest.raises(NotFoundError):
        s.put_end("k", meta.put_id, 42)  # not in progress any more


def test_put_ids_are_capabilities(clock):
    s = make(clock)
    ids = {s.put_start(f"k{i}", 10).put_id for i in range(200)}
    assert len(ids) == 200 and all(0 < i < 1 << 63 for i in ids)  # random, never reused
    meta = s.objects["k0"]
    with pytest.raises(NotFoundError):
        s.put_revoke("k0", meta.put_id ^ 1)
    assert "k0" in s.objects
    s.put_revoke("k0", meta.put_id)
    assert "k0" not in s.objects


def test_revoke_and_put_timeout_reclaim_space(clock):
    s = make(clock, put_timeout=30, put_min_rate="10KiB", node_ttl=1000)
    a = s.put_start("a", 40 * KiB)
    s.put_revoke("a", a.put_id)
    assert s.usage() == (0, 100 * KiB) and "a" not in s.objects
    b = s.put_start("b", 40 * KiB)
    clock.t += 33  # 30 s plus 40 KiB at 10 KiB/s: not yet
    assert s.tick() == ([], [])
    clock.t += 2
    revoked, _dead = s.tick()
    assert revoked == ["b"] and s.usage()[0] == 0
    with pytest.raises(NotFoundError):
        s.put_revoke("b", b.put_id)


def test_unfinished_puts_are_capped_per_client(clock):
    s = make(clock, max_pending_bytes="50KiB")
    first = s.put_start("a", 30 * KiB, owner="c1")
    with pytest.raises(BackpressureError, match="unfinished puts"):
        s.put_start("b", 30 * KiB, owner="c1")
    s.put_start("b", 30 * KiB, owner="c2")  # another client has its own allowance
    s.put_end("a", first.put_id, 0)
    s.put_start("c", 30 * KiB, owner="c1")  # ended puts no longer count
    assert s.pending_bytes == {"c1": 30 * KiB, "c2": 30 * KiB}
    clock.t += 100
    s.tick()  # revoked at their deadline: nothing counts any more
    assert s.pending_bytes == {}


def test_lease_blocks_removal_and_eviction(clock):
    s = make(clock, lease_ttl=10, high_watermark=0.95, low_watermark=0.5)
    put(s, "old", 40 * KiB)
    put(s, "mid", 40 * KiB)
    s.get("old")  # leased for 10 s
    with pytest.raises(LeaseExpiredError):
        s.remove("old")
    assert s.counters["lease_conflicts"] == 1
    s.put_start("new", 40 * KiB)  # needs room: "mid" goes, leased "old" stays
    assert "old" in s.objects and "mid" not in s.objects
    clock.t += 11
    s.remove("old")  # lease over
    assert not s.exists("old")
    put(s, "x", 10 * KiB)
    s.get("x")
    s.remove("x", force=True)  # forced removal ignores the lease
    assert not s.exists("x")


def test_eviction_prefers_cold_over_recent_one_offs(clock):
    """Decayed frequency: a block read many times stays although a one-off is newer."""
    s = make(clock, capacity=100 * KiB, high_watermark=0.95, low_watermark=0.6, lease_ttl=1)
    put(s, "hot", 30 * KiB)
    for _ in range(5):
        clock.t += 2
        s.get("hot")
    clock.t += 2
    put(s, "oneoff", 30 * KiB)
    clock.t += 2
    put(s, "warm", 30 * KiB)
    s.get("warm")
    clock.t += 2
    evicted = s.evict(Tier.DRAM, need=30 * KiB)
    assert evicted == ["oneoff"]  # coldest first; stops once enough is free
    assert set(s.objects) == {"hot", "warm"}


def test_watermark_eviction_frees_down_to_low_mark(clock):
    s = make(clock, capacity=100 * KiB, high_watermark=0.9, low_watermark=0.5, lease_ttl=0.5)
    for i in range(9):
        put(s, f"k{i}", 10 * KiB)
        clock.t += 1
    assert s.usage()[0] == 90 * KiB  # at the high mark, not above: nothing evicted
    put(s, "k9", 10 * KiB)  # 100 % > 90 %: evict the oldest down to 50 %
    used, _cap = s.usage()
    assert used <= 50 * KiB
    assert sorted(s.objects) == ["k5", "k6", "k7", "k8", "k9"]
    assert s.counters["evictions"] == 5


def test_pinned_objects_go_last_and_cooldown_protects(clock):
    s = make(clock, capacity=100 * KiB, high_watermark=0.99, low_watermark=0.3, lease_ttl=0.1)
    put(s, "pinned", 30 * KiB)
    s.pin("pinned")
    clock.t += 1
    put(s, "plain", 30 * KiB)
    clock.t += 1
    put(s, "cool", 30 * KiB)
    s.objects["cool"].cooldown_until = clock.t + 100
    clock.t += 1
    assert s.evict(Tier.DRAM, need=60 * KiB) == ["plain", "pinned"]
    assert list(s.objects) == ["cool"]


def test_replicas_go_to_distinct_nodes(clock):
    s = make(clock, nodes=("n1", "n2", "n3"), replicas=2)
    meta = s.put_start("k", 1000)
    assert len({r.node_id for r in meta.replicas}) == 2
    meta3 = s.put_start("k3", 1000, replicas=3)
    assert sorted(r.node_id for r in meta3.replicas) == ["n1", "n2", "n3"]
    one = make(clock, nodes=("n1",), replicas=2)
    assert len(one.put_start("k", 1000).replicas) == 1  # fewer nodes than replicas: best effort


def test_dead_node_drops_its_replicas(clock):
    s = make(clock, nodes=("n1", "n2"), replicas=2, node_ttl=10)
    put(s, "both", 1000)
    put(s, "single", 1000, replicas=1)
    single_node = s.objects["single"].replicas[0].node_id
    clock.t += 5
    s.heartbeat("n1" if single_node == "n2" else "n2")  # the other node stays alive
    clock.t += 6
    _, dead = s.tick()
    assert dead == [single_node]
    assert s.exists("both") and len(s.objects["both"].replicas) == 1
    assert not s.exists("single")  # a clean miss, never a dangling replica
    assert s.heartbeat(single_node) is False  # it must mount again


def test_no_space_and_bad_input(clock):
    s = make(clock, capacity=10 * KiB, max_object_bytes="8KiB")
    with pytest.raises(BadRequestError):
        s.put_start("", 10)
    with pytest.raises(BadRequestError):
        s.put_start("k", 0)
    with pytest.raises(BadRequestError):
        s.put_start("k", 9 * KiB)  # over max_object_bytes
    with pytest.raises(BadRequestError):
        s.put_start("x" * 5000, 10)
    for replicas in (-1, 0, 17, 1.5, True, "2"):
        with pytest.raises(BadRequestError, match="replicas"):
            s.put_start("k", 10, replicas=replicas)
    assert not s.objects
    put(s, "a", 6 * KiB)
    s.get("a")  # leased: cannot be evicted
    with pytest.raises(NoSpaceError):
        s.put_start("b", 6 * KiB)
    assert "b" not in s.objects and s.usage()[0] == 6 * KiB
    with pytest.raises(NotFoundError):
        s.remove("nope")
    with pytest.raises(NotFoundError):
        s.pin("nope")
    empty = MasterState(MasterConfig(), clock=clock)
    with pytest.raises(NoSpaceError):
        empty.put_start("k", 10)


def test_rebuild_from_node_reports(clock):
    s = make(clock)
    put(s, "k", 5000)
    replica = s.objects["k"].replicas[0]
    fresh = make(clock)
    fresh.adopt("n1", "k", 5000, Replica("n1", replica.segment, replica.offset, Tier.DRAM), 7)
    assert fresh.exists("k") and fresh.get("k").checksum == 7
    assert fresh.usage()[0] == s.usage()[0]
    with pytest.raises(BadRequestError):
        fresh.adopt("n2", "z", 10, Replica("n2", "n1/dram", 0, Tier.DRAM), None)
    put(fresh, "new", 1000)  # never overlaps the adopted range
    new = fresh.objects["new"].replicas[0]
    assert new.offset >= replica.offset + 5000 or new.offset + 1000 <= replica.offset


def up(state: MasterState, key: str, size: int, **opts):
    from kvpool.store.master.objects import PutOptions

    return state.put_start(key, size, opts=PutOptions(upsert=True, **opts))


def test_an_upsert_replaces_and_the_old_bytes_outlive_their_readers(clock):
    s = make(clock, lease_ttl=10, node_ttl=1000)
    put(s, "k", 10 * KiB)
    old = s.get("k").replicas[0]  # a reader holds a lease on the old version
    new = up(s, "k", 20 * KiB)
    assert s.objects["k"].size == 10 * KiB  # until the upsert ends, the old one is the key's
    with pytest.raises(PutInProgressError):
        up(s, "k", 5)
    s.put_end("k", new.put_id, 7)
    assert s.objects["k"] is new and s.get("k").checksum == 7
    assert s.usage()[0] == 30 * KiB  # the old replica still holds its bytes for the reader
    clock.t += 11
    s.tick()
    assert s.usage()[0] == 20 * KiB and s.retired == []  # freed once the lease ran out
    assert old.offset != s.objects["k"].replicas[0].offset


def test_a_revoked_or_expired_upsert_leaves_the_old_version(clock):
    s = make(clock, put_timeout=5, node_ttl=1000)
    put(s, "k", 1000)
    a = up(s, "k", 2000)
    s.put_revoke("k", a.put_id)
    assert s.objects["k"].size == 1000 and s.upserts == {}
    up(s, "k", 3000)
    clock.t += 10
    assert s.tick()[0] == ["k"]
    assert s.objects["k"].size == 1000 and s.exists("k")
    b = up(s, "new-key", 10)  # an upsert of a missing key is a plain put
    assert s.objects["new-key"] is b


def test_pins_hard_never_evicted_soft_last_until_their_ttl(clock):
    from kvpool.store.master.objects import PutOptions

    s = make(clock, high_watermark=0.95, low_watermark=0.1)

    def put_with(key, **opts):
        meta = s.put_start(key, 20 * KiB, opts=PutOptions(**opts))
        s.put_end(key, meta.put_id, 0)

    put_with("hard", hard_pin=True)
    put_with("soft", soft_pin=True)
    put_with("brief", soft_pin=True, pin_ttl=5)
    put_with("plain")
    clock.t += 1
    assert s.evict(Tier.DRAM, need=0) == ["plain", "soft", "brief"]  # pinned last, coldest first
    assert list(s.objects) == ["hard"]  # down to 10 %, but a hard pin stays
    put_with("brief2", soft_pin=True, pin_ttl=5)
    put_with("plain2")
    clock.t += 6  # the brief pin ran out: it goes with the unpinned, coldest first
    assert s.evict(Tier.DRAM, need=0) == ["brief2", "plain2"]


def test_preferred_nodes_are_tried_first(clock):
    from kvpool.store.master.objects import PutOptions

    s = make(clock, nodes=("n1", "n2", "n3"))
    for pref in ["n2", "n3/dram", "n3"]:
        meta = s.put_start(f"k-{pref}", 100, opts=PutOptions(preferred=(pref,)))
        assert meta.replicas[0].node_id == pref.split("/")[0]
    meta = s.put_start("elsewhere", 100, opts=PutOptions(preferred=("no-such-node",)))
    assert meta.replicas  # an unknown preference is ignored, as Mooncake does


def test_remove_matching_skips_leased_objects_unless_forced(clock):
    s = make(clock, lease_ttl=10)
    for key in ["a/1", "a/2", "b/1", "c"]:
        put(s, key, 100)
    s.get("a/2")  # leased
    s.put_start("a/3", 100)  # in progress: not a complete object, never removed
    assert s.remove_matching("^a/") == 1 and set(s.objects) == {"a/2", "a/3", "b/1", "c"}
    assert s.remove_matching("^a/", force=True) == 1
    with pytest.raises(BadRequestError, match="regular expression"):
        s.remove_matching("([")
    assert s.remove_matching(None) == 2 and list(s.objects) == ["a/3"]


def test_a_lookup_leases_the_object_as_in_mooncake(clock):
    s = make(clock, lease_ttl=2.0)
    put(s, "k", 100)
    s.remove("k")  # never looked at: no lease
    put(s, "k", 100)
    assert s.exists("k")
    with pytest.raises(LeaseExpiredError):
        s.remove("k")  # a lookup is followed by a read: it must not go in between
    clock.t += 2.1
    s.remove("k")
    assert not s.exists("missing")


def test_a_node_reported_unreachable_is_suspect_until_it_heartbeats(clock):
    s = make(clock, nodes=("n1", "n2"), capacity=10 * KiB)
    put(s, "k", 100)
    holder = s.objects["k"].replicas[0].node_id
    other = "n2" if holder == "n1" else "n1"
    with pytest.raises(AlreadyExistsError):
        s.put_start("k", 100)
    assert s.report_unreachable([holder, "unknown-node"]) == 1
    assert s.suspect(holder) and not s.suspect(other)
    meta = s.put_start("k", 100)  # its only holder may be gone: a real put, elsewhere
    assert [r.node_id for r in meta.replicas] == [other]
    s.put_end("k", meta.put_id, 1)
    clock.t += 0.5
    s.heartbeat(holder)  # alive after all: the report no longer counts
    assert not s.suspect(holder)
    s.report_unreachable([other])
    big = s.put_start("big", 6 * KiB)  # prefers the node nobody reported
    assert [r.node_id for r in big.replicas] == [holder]
    s.report_unreachable([holder])
    clock.t += 0.1
    last = s.put_start("last", 6 * KiB)  # both suspect: still placed (a report cannot block puts)
    assert len(last.replicas) == 1

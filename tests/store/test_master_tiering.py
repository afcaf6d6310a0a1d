"""DRAM <-> SSD tiering rules, with a mover that really copies between fake node memories."""

from __future__ import annotations

import os

import pytest
from fake_clock import Clock

from kvpool.config import MasterConfig
from kvpool.store.master.objects import Replica, Tier
from kvpool.store.master.state import MasterState

KiB = 1024


class Memories:
    """Byte arrays standing in for node segments; the mover copies between them."""

    def __init__(self) -> None:
        self.mem: dict[str, bytearray] = {}
        self.moves: list[tuple[str, str]] = []
        self.fail = False

    def mover(self, src: Replica, dst: Replica, size: int) -> bool:
        if self.fail:
            return False
        self.mem[dst.segment][dst.offset : dst.offset + size] = self.mem[src.segment][
            src.offset : src.offset + size
        ]
        self.moves.append((src.tier.value, dst.tier.value))
        return True


@pytest.fixture
def env():
    clock, mems = Clock(), Memories()
    s = MasterState(
        MasterConfig(high_watermark=0.95, low_watermark=0.5, lease_ttl=1, cooldown=5),
        clock=clock,
    )
    s.mover = mems.mover
    for seg, tier, cap in (("n1/dram", Tier.DRAM, 100 * KiB), ("n1/ssd", Tier.SSD, 300 * KiB)):
        s.mount("n1", seg, tier, cap)
        mems.mem[seg] = bytearray(cap)
    return s, clock, mems


def put(s, mems, key, size):
    value = os.urandom(size)
    meta = s.put_start(key, size)
    r = meta.replicas[0]
    mems.mem[r.segment][r.offset : r.offset + size] = value
    s.put_end(key, meta.put_id, 0)
    return value


def read(s, mems, key):
    meta = s.get(key)
    r = meta.replicas[0]
    return r.tier, bytes(mems.mem[r.segment][r.offset : r.offset + meta.size])


def test_eviction_offloads_to_ssd_and_a_get_promotes_back(env):
    s, clock, mems = env
    values = {}
    for i in range(4):
        values[f"k{i}"] = put(s, mems, f"k{i}", 30 * KiB)
        clock.t += 2
    assert s.counters["offloads"] >= 1  # 120 KiB through 100 KiB of DRAM
    offloaded = [k for k, m in s.objects.items() if m.replicas[0].tier is Tier.SSD]
    assert offloaded and offloaded[0] == "k0"  # the coldest went
    clock.t += 1  # still cooling down: served from SSD, not moved
    tier, data = read(s, mems, "k0")
    assert (tier, data) == (Tier.SSD, values["k0"])
    clock.t += 10  # cool-down over, lease over: the next get promotes it
    for k in [k for k, m in s.objects.items() if m.replicas[0].tier is Tier.DRAM][:1]:
        s.remove(k, force=True)  # make room in DRAM
    tier, data = read(s, mems, "k0")
    assert tier is Tier.DRAM and data == values["k0"]
    assert s.counters["promotions"] == 1
    for key, value in values.items():
        if key in s.objects:
            assert read(s, mems, key)[1] == value  # every byte survived every move


def test_full_ssd_drops_its_coldest(env):
    s, clock, mems = env
    for i in range(16):  # 480 KiB through 100 KiB DRAM + 300 KiB SSD
        put(s, mems, f"k{i}", 30 * KiB)
        clock.t += 6  # past each cool-down
    used_ssd, cap_ssd = s.usage(Tier.SSD)
    assert 0 < used_ssd <= cap_ssd
    assert "k0" not in s.objects and "k15" in s.objects  # coldest dropped from SSD
    assert s.counters["evictions"] > s.counters["offloads"] - 1


def test_failed_copy_drops_instead_of_offloading(env):
    s, clock, mems = env
    mems.fail = True
    for i in range(4):
        put(s, mems, f"k{i}", 30 * KiB)
        clock.t += 2
    assert s.counters["offloads"] == 0 and "k0" not in s.objects
    assert s.usage(Tier.SSD)[0] == 0  # nothing left allocated on SSD


def test_no_ssd_tier_means_plain_eviction():
    clock = Clock()
    s = MasterState(MasterConfig(high_watermark=0.95, low_watermark=0.5), clock=clock)
    s.mover = Memories().mover
    s.mount("n1", "n1/dram", Tier.DRAM, 100 * KiB)
    for i in range(4):
        meta = s.put_start(f"k{i}", 30 * KiB)
        s.put_end(f"k{i}", meta.put_id, 0)
        clock.t += 2
    assert s.counters["offloads"] == 0 and s.counters["evictions"] >= 1

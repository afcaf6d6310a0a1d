"""OffsetAllocator: exact unit tests, a model-checked state machine and a churn test."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.store.master.allocator import OffsetAllocator

KiB, MiB = 1024, 1024 * 1024


def filled(capacity: int, sizes: list[int], alignment: int = 64) -> tuple[OffsetAllocator, list]:
    alloc = OffsetAllocator(capacity, alignment)
    offsets = [alloc.allocate(s) for s in sizes]
    return alloc, offsets


# -- exact unit tests --------------------------------------------------------------------------


def test_first_allocations_are_contiguous_and_aligned():
    alloc, offsets = filled(1024, [100, 64, 1])
    assert offsets == [0, 128, 192]
    assert [alloc.allocated_size(o) for o in offsets] == [128, 64, 64]
    assert (alloc.used, alloc.free_bytes, alloc.largest_free) == (256, 768, 768)
    assert alloc.free_ranges() == [(256, 768)]
    assert alloc.fragmentation() == 0.0


def test_exhaustion_returns_none():
    alloc, offsets = filled(256, [64, 64, 64, 64])
    assert offsets == [0, 64, 128, 192]
    assert alloc.allocate(1) is None
    assert (alloc.used, alloc.free_bytes, alloc.largest_free) == (256, 0, 0)
    assert alloc.fragmentation() == 0.0
    alloc.free(64)
    assert alloc.allocate(65) is None  # 128 rounded: 64 bytes free are not enough
    assert alloc.allocate(64) == 64


@pytest.mark.parametrize(
    ("frees", "expected"),
    [
        ([0, 64], [(0, 128), (256, 768)]),  # 64 merges with its left neighbour
        ([64, 0], [(0, 128), (256, 768)]),  # 0 merges with its right neighbour
        ([0, 128, 64], [(0, 192), (256, 768)]),  # 64 merges with both
        ([0, 128, 64, 192], [(0, 1024)]),  # 192 merges with both, the tail included
        ([192], [(192, 832)]),  # right neighbour is the tail
    ],
)
def test_free_coalesces_with_neighbours(frees, expected):
    alloc, offsets = filled(1024, [64, 64, 64, 64])
    assert offsets == [0, 64, 128, 192]
    for offset in frees:
        alloc.free(offset)
    assert alloc.free_ranges() == expected
    assert alloc.largest_free == max(size for _, size in expected)
    assert alloc.free_bytes == sum(size for _, size in expected) == 1024 - alloc.used


def test_best_fit_picks_the_smallest_fitting_hole():
    # Layout: hole192 @0 | sep @192 | hole64 @256 | sep @320 | hole128 @384 | sep @512 | tail @576
    alloc, offsets = filled(4096, [192, 64, 64, 64, 128, 64])
    assert offsets == [0, 192, 256, 320, 384, 512]
    for offset in (0, 256, 384):
        alloc.free(offset)
    assert alloc.free_ranges() == [(0, 192), (256, 64), (384, 128), (576, 3520)]
    assert alloc.allocate(100) == 384  # 128: exact fit, not the 192 hole nor the tail
    assert alloc.allocate(10) == 256  # 64
    assert alloc.allocate(129) == 0  # 192
    assert alloc.allocate(200) == 576  # only the tail is left
    assert alloc.free_ranges() == [(832, 3264)]


def test_best_fit_tie_goes_to_the_lowest_offset():
    alloc, _ = filled(1024, [64, 64, 64, 64, 64])
    alloc.free(192)
    alloc.free(64)
    assert alloc.allocate(64) == 64
    assert alloc.allocate(64) == 192


def test_double_free_and_bad_offsets_raise():
    alloc, _ = filled(1024, [128, 64])
    alloc.free(0)
    before = (alloc.used, alloc.free_ranges(), alloc.snapshot())
    for bad in (0, 64, 130, 2048, -64):  # double free, range start freed, inside, outside
        with pytest.raises(KeyError):
            alloc.free(bad)
    with pytest.raises(KeyError):
        alloc.allocated_size(0)
    assert (alloc.used, alloc.free_ranges(), alloc.snapshot()) == before


def test_bad_sizes_and_parameters_raise():
    alloc = OffsetAllocator(1024)
    for size in (0, -1, 1025):
        with pytest.raises(ValueError):
            alloc.allocate(size)
    with pytest.raises(ValueError):
        OffsetAllocator(1000).allocate(1000)  # rounds to 1024: can never fit
    for capacity, alignment in ((0, 64), (-64, 64), (1024, 0), (1024, 48)):
        with pytest.raises(ValueError):
            OffsetAllocator(capacity, alignment)
    assert (alloc.used, alloc.free_ranges()) == (0, [(0, 1024)])


def test_unaligned_capacity_keeps_a_short_tail():
    alloc = OffsetAllocator(1000)
    assert alloc.allocate(900) == 0
    assert (alloc.used, alloc.free_ranges()) == (960, [(960, 40)])
    assert alloc.allocate(1) is None  # rounds to 64 > 40
    alloc.free(0)
    assert alloc.free_ranges() == [(0, 1000)]


def test_reserve_and_restore_rebuild_the_same_state():
    rng = np.random.default_rng(1)
    alloc = OffsetAllocator(64 * KiB)
    live = [o for o in (alloc.allocate(int(s)) for s in rng.integers(1, 3000, 30)) if o is not None]
    for offset in live[::3]:
        alloc.free(offset)
    held = alloc.snapshot()
    rebuilt = OffsetAllocator(64 * KiB)
    for i in rng.permutation(len(held)):  # nodes report in any order
        rebuilt.reserve(*held[i])
    restored = OffsetAllocator.restore(64 * KiB, list(reversed(held)))
    for other in (rebuilt, restored):
        assert other.snapshot() == held
        assert other.free_ranges() == alloc.free_ranges()
        assert (other.used, other.free_bytes) == (alloc.used, alloc.free_bytes)
    assert alloc.allocate(1000) == rebuilt.allocate(1000) == restored.allocate(1000)


def test_reserve_rejects_overlap_and_bad_ranges():
    alloc = OffsetAllocator(1024)
    alloc.reserve(128, 100)
    assert alloc.free_ranges() == [(0, 128), (256, 768)]
    before = (alloc.snapshot(), alloc.free_ranges())
    bad = [(192, 64), (64, 128), (0, 1024), (128, 1), (100, 64), (-64, 64), (960, 128), (0, 0)]
    for offset, size in bad:  # overlaps x4, misaligned, negative, past the end, empty
        with pytest.raises(ValueError):
            alloc.reserve(offset, size)
    assert (alloc.snapshot(), alloc.free_ranges()) == before
    alloc.reserve(0, 128)  # exactly the hole before it
    assert alloc.free_ranges() == [(256, 768)]
    for allocations in ([(0, 128), (64, 64)], [(0, 64), (0, 64)], [(32, 64)], [(1000, 64)]):
        with pytest.raises(ValueError):
            OffsetAllocator.restore(1024, allocations)


# -- model-checked state machine ---------------------------------------------------------------


def free_runs(bitmap: bytearray) -> list[tuple[int, int]]:
    """The maximal runs of free bytes as ``(offset, size)``: what a coalescing list must hold."""
    return [(m.start(), m.end() - m.start()) for m in re.finditer(rb"\x00+", bitmap)]


class AllocatorMachine(RuleBasedStateMachine):
    """Checks every step against a byte bitmap: placement (best fit), overlap, coalescing."""

    CAPACITY, ALIGN = 1000, 32  # unaligned capacity: the short tail is exercised too

    def __init__(self) -> None:
        super().__init__()
        self.alloc = OffsetAllocator(self.CAPACITY, self.ALIGN)
        self.bitmap = bytearray(self.CAPACITY)
        self.live: dict[int, int] = {}

    def mark(self, offset: int, size: int) -> None:
        assert offset % self.ALIGN == 0 and offset >= 0 and offset + size <= self.CAPACITY
        assert not any(self.bitmap[offset : offset + size]), "overlaps a live range"
        self.bitmap[offset : offset + size] = b"\x01" * size
        self.live[offset] = size

    @rule(size=st.integers(1, CAPACITY))
    def allocate(self, size: int) -> None:
        rounded = -(-size // self.ALIGN) * self.ALIGN
        if rounded > self.CAPACITY:
            with pytest.raises(ValueError):
                self.alloc.allocate(size)
            return
        fits = [(n, s) for s, n in free_runs(self.bitmap) if n >= rounded]
        offset = self.alloc.allocate(size)
        assert offset == (min(fits)[1] if fits else None)  # best fit, lowest offset on ties
        if offset is not None:
            self.mark(offset, rounded)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        self.alloc.free(offset)
        size = self.live.pop(offset)
        self.bitmap[offset : offset + size] = bytes(size)

    @rule(offset=st.integers(-1, CAPACITY))
    def free_bad_offset(self, offset: int) -> None:
        if offset not in self.live:
            with pytest.raises(KeyError):
                self.alloc.free(offset)

    @rule(unit=st.integers(0, CAPACITY // ALIGN), size=st.integers(1, 300))
    def reserve(self, unit: int, size: int) -> None:
        offset, rounded = unit * self.ALIGN, -(-size // self.ALIGN) * self.ALIGN
        end = offset + rounded
        if end <= self.CAPACITY and not any(self.bitmap[offset:end]):
            self.alloc.reserve(offset, size)
            self.mark(offset, rounded)
        else:
            with pytest.raises(ValueError):
                self.alloc.reserve(offset, size)

    @invariant()
    def matches_the_model(self) -> None:
        runs = free_runs(self.bitmap)
        assert self.alloc.free_ranges() == runs  # coalesced: free ranges are the maximal runs
        assert self.alloc.snapshot() == sorted(self.live.items())
        assert self.alloc.used == sum(self.bitmap) == sum(self.live.values())
        assert self.alloc.used + self.alloc.free_bytes == self.CAPACITY
        assert self.alloc.largest_free == max((n for _, n in runs), default=0)

    def teardown(self) -> None:
        for offset in list(self.live):
            self.alloc.free(offset)
        assert self.alloc.free_ranges() == [(0, self.CAPACITY)]
        assert (self.alloc.used, self.alloc.free_bytes) == (0, self.CAPACITY)


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase


# -- churn: no fragmentation blow-up -----------------------------------------------------------


def churn(alloc: OffsetAllocator, ops: int, target: float = 0.7, seed: int = 0) -> dict:
    """Random puts and random frees around ``target`` fill; per-failure and sampled figures."""
    # KV-block mix: 30 % fixed 736 KiB blocks, the rest log-uniform in 16 KiB..2 MiB.
    rng = np.random.default_rng(seed)
    spread = np.exp(rng.uniform(np.log(16 * KiB), np.log(2 * MiB), ops)).astype(np.int64)
    sizes = np.where(rng.random(ops) < 0.3, 736 * KiB, spread)
    coin, pick = rng.random(ops), rng.random(ops)
    live: list[int] = []
    tries, failures, frags = 0, [], []
    for i in range(ops):
        fill = alloc.used / alloc.capacity
        # Allocation probability falls as fill rises: fill wanders around the target (up to
        # ~0.85 observed) instead of sitting on it, so genuine failures can happen.
        if coin[i] < 0.5 + 2.0 * (target - fill) or not live:
            tries += 1
            offset = alloc.allocate(int(sizes[i]))
            if offset is None:
                failures.append((int(sizes[i]), alloc.free_bytes, alloc.largest_free))
            else:
                live.append(offset)
        else:  # free a random live object (random lifetimes: the hard case for any allocator)
            j = int(pick[i] * len(live))
            live[j], live[-1] = live[-1], live[j]
            alloc.free(live.pop())
        if i % 100 == 0:
            frags.append(alloc.fragmentation())
            assert len(alloc.free_ranges()) <= len(live) + 1  # coalesced: holes sit between
    return {"tries": tries, "failures": failures, "frags": frags, "live": live}


def test_churn_has_no_fragmentation_blowup():
    """64 MiB, ~70 % full, 200,000 random operations.

    Observed (-s), seed 0: 100,049 tries, 7 failures (success 0.99993), all for requests of
    1.40..1.97 MiB while the largest hole was >= 1.07 MiB; worst failure at free_bytes = size +
    27.7 % of capacity; fragmentation() mean 0.590 (sampled every 100 ops), final 0.569;
    ~400k ops/s. Seeds 0..9: success 0.99993..0.99999, worst slack 0.18..0.32, smallest failed
    request 1.40 MiB, mean fragmentation 0.582..0.596, final 0.31..0.81 (one sample: noisy).
    Worst fit: 0.85 success / 0.95 mean fragmentation; no coalescing: 0.13 / 0.995. Random
    lifetimes leave the ~30 % free space in ~40 holes, so ~0.6 is the steady state of any
    allocator that never moves data (0.5 is out of reach); the bounds sit below blow-up.
    """
    alloc = OffsetAllocator(64 * MiB)
    start = time.perf_counter()
    stats = churn(alloc, 200_000)
    elapsed = time.perf_counter() - start
    failures, frags = stats["failures"], stats["frags"]
    success = 1 - len(failures) / stats["tries"]
    worst_slack = max((free - size for size, free, _ in failures), default=0) / alloc.capacity
    print(
        f"\nchurn: tries={stats['tries']} failures={len(failures)} success={success:.5f} "
        f"worst_slack={worst_slack:.3f} frag_mean={np.mean(frags):.3f} "
        f"frag_final={alloc.fragmentation():.3f} ops/s={200_000 / elapsed:,.0f}"
    )
    for size, _free, largest in failures:
        assert largest < -(-size // 64) * 64  # a failure is real: no hole fits the request
        assert size > 1 * MiB  # observed: no request up to 1 MiB (736 KiB blocks) ever failed
    # No allocator that never moves data has a useful worst-case bound (Robson), so this
    # slack is empirical: observed <= 0.32 over seeds 0..9, with margin.
    assert worst_slack < 0.35
    assert success >= 0.9995
    assert np.mean(frags) < 0.7
    assert alloc.fragmentation() < 0.9
    assert alloc.used + alloc.free_bytes == alloc.capacity
    for offset in stats["live"]:
        alloc.free(offset)
    assert alloc.free_ranges() == [(0, 64 * MiB)]

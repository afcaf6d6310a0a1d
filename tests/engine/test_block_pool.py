import pytest

from kvpool.engine.block_pool import BlockPool


def test_block_zero_is_reserved_and_allocation_is_in_order():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.allocate(2) is None  # short: nothing changes
    assert pool.num_free_blocks == 1
    assert pool.blocks[0].ref_cnt == 1


def test_free_puts_uncached_first_and_cached_in_lru_order():
    pool = BlockPool(6)
    a, b, c, _d = pool.allocate(4)
    pool.cache_block(a, b"ha", (1,))
    pool.cache_block(b, b"hb", (2,))
    pool.free([b])  # cached: goes to the tail
    pool.free([a])  # cached: after b
    pool.free([c])  # uncached: goes to the head
    # Free order now: c (uncached), 5 (never used), b, a
    got = [blk.block_id for blk in pool.allocate(4)]
    assert got == [c.block_id, 5, b.block_id, a.block_id]
    assert pool.stats.evictions == 2
    assert pool.lookup(b"ha", (1,)) is None


def test_cached_free_block_is_reused_by_touch():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    assert pool.cache_block(a, b"h", (7, 8))
    pool.free([a])
    assert a.ref_cnt == 0 and pool.num_free_blocks == 3
    hit = pool.lookup(b"h", (7, 8))
    assert hit is a
    pool.touch([hit])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([hit])
    assert a.ref_cnt == 2
    pool.free([a, a])
    assert a.ref_cnt == 0


def test_forced_hash_collision_is_a_miss():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"same-hash", (1, 2, 3))
    assert pool.lookup(b"same-hash", (1, 2, 4)) is None
    assert pool.stats.hash_collisions == 1
    assert pool.lookup(b"same-hash", (1, 2, 3)) is a


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"h", (1,))
    assert not pool.cache_block(b, b"h", (1,))
    assert b.block_hash is None
    assert pool.lookup(b"h", (1,)) is a


def test_double_free_is_caught():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(AssertionError):
        pool.free([a])


def test_caching_disabled_never_hits():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, b"h", (1,))
    assert pool.lookup(b"h", (1,)) is None


def test_usage_and_reset_cache():
    pool = BlockPool(5)
    blocks = pool.allocate(2)
    assert pool.usage() == pytest.approx(0.5)
    pool.cache_block(blocks[0], b"x", (1,))
    pool.free(blocks)
    assert pool.usage() == 0.0
    assert pool.reset_cache() == 1
    assert pool.lookup(b"x", (1,)) is None

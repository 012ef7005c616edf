"""Block pool and KV manager invariants under random add/grow/abort/finish sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvserve.kvcache.block_pool import BlockPool, BlockPoolError
from kvserve.kvcache.manager import KVCacheManager, blocks_for_tokens


def test_double_free_and_foreign_block_are_errors():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(BlockPoolError):
        pool.free(blocks[:1])
    with pytest.raises(BlockPoolError):
        pool.free([7])
    with pytest.raises(BlockPoolError):
        pool.allocate(5)


def test_shared_block_is_freed_by_last_owner():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.share(block)
    pool.free([block])
    assert pool.num_free_blocks == 1 and pool.ref_count(block) == 1
    pool.free([block])
    assert pool.num_free_blocks == 2 and pool.ref_count(block) == 0


def test_blocks_to_avoid_come_after_other_empty_and_cached_blocks():
    """A load's destinations skip blocks the step in flight may still use: other empty blocks
    first, then evicted cached ones, the avoided ones only when nothing else is free."""
    from kvserve.kvcache.policies import make_policy
    from kvserve.kvcache.prefix_cache import PrefixCache
    cache = PrefixCache(make_policy("lru", num_blocks=4))
    pool = BlockPool(4, cache)
    cache.insert(0, b"h0", b"root", [1, 2], "ns", 0)  # one cached block; the rest get freed
    blocks = pool.allocate(4)
    assert blocks == [0, 1, 2, 3]
    pool.free([0, 1, 2, 3])                           # 0 cached, 1-3 empty (just freed)
    assert pool.allocate(2, avoid={1, 2}) == [3, 0]   # the other empty one, then the cached one
    assert not cache.holds(0)
    assert pool.allocate(2, avoid={1, 2}) == [1, 2]   # nothing else is free: the avoided ones
    assert pool.num_free_blocks == 0
    pool.free([3, 1])
    assert pool.allocate(1, avoid={3}) == [1] and pool.allocate(1) == [3]   # the avoided one stays free


def test_allocation_failure_changes_nothing():
    manager = KVCacheManager(num_blocks=3, block_size=4)
    assert manager.allocate_slots("a", 8)
    assert not manager.allocate_slots("b", 8)
    assert manager.block_table("b") == [] and manager.num_free_blocks == 1


operations = st.lists(st.tuples(st.sampled_from(["grow", "finish"]), st.integers(0, 5), st.integers(1, 40)),
                      max_size=120)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]), ops=operations)
def test_manager_never_leaks_or_double_allocates(num_blocks, block_size, ops):
    manager = KVCacheManager(num_blocks, block_size)
    lengths: dict[str, int] = {}
    for op, rid, grow in ops:
        request_id = f"r{rid}"
        if op == "grow":
            target = lengths.get(request_id, 0) + grow
            if manager.allocate_slots(request_id, target):
                lengths[request_id] = target
        else:
            manager.free(request_id)
            lengths.pop(request_id, None)
        # Every block is owned by exactly one table or free, never both, never twice.
        owned = [b for t in manager.block_tables.values() for b in t]
        assert len(owned) == len(set(owned))
        assert len(owned) + manager.num_free_blocks == num_blocks
        for request, table in manager.block_tables.items():
            assert len(table) == blocks_for_tokens(lengths.get(request, 0), block_size)
            assert all(manager.pool.ref_count(b) == 1 for b in table)
    for request_id in list(manager.block_tables):
        manager.free(request_id)
    assert manager.num_free_blocks == num_blocks

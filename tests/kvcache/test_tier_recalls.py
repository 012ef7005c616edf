"""Recalls of tiered blocks (KVCacheManager.recall): the recalls queued in a row, across requests,
travel in one copy; a request freed before the copy is issued takes only its own blocks out of it;
a landed copy reports each recall to its own request; nothing leaks."""

from __future__ import annotations

from kvserve.kvcache.host_tier import HostTier
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.policies import make_policy
from kvserve.kvcache.prefix_cache import PrefixCache
from kvserve.kvstore import DEVICE_STORE, HOST_STORE

BLOCK = 4


def _manager() -> KVCacheManager:
    manager = KVCacheManager(16, BLOCK, PrefixCache(make_policy("lru", num_blocks=16)), HostTier(16))
    for request_id in ("a", "b", "c"):
        assert manager.allocate_slots(request_id, 3 * BLOCK)
        assert manager.copy_to_host(request_id, [0, 1]) is not None
        manager.demote(request_id, [0, 1])
    manager.take_block_copies()
    return manager


def _held(manager: KVCacheManager, request_id: str) -> list[int]:
    return sorted(manager._tier_host_ids[request_id])


def test_recalls_in_a_row_share_one_copy_and_land_per_request():
    manager = _manager()
    recalls = {rid: [manager.recall(rid, host) for host in _held(manager, rid)] for rid in ("a", "b")}
    (copy,) = manager.take_block_copies()
    assert (copy.source, copy.destination) == (HOST_STORE, DEVICE_STORE)
    assert sorted(copy.src_block_ids) == sorted(_held(manager, "a") + _held(manager, "b"))
    manager.complete_transfer(copy.ticket, ok=True)
    for rid in ("a", "b"):
        landed = manager.take_recalls(rid)
        assert [recall for recall, _ in landed] == recalls[rid]
        assert all(block is not None for _, block in landed)
    assert manager.take_recalls("c") == []


def test_a_request_freed_before_the_copy_is_issued_takes_only_its_blocks_out():
    manager = _manager()
    free_before = manager.num_free_blocks
    for rid in ("a", "b", "c"):
        for host in _held(manager, rid):
            manager.recall(rid, host)
    manager.free("b")
    (copy,) = manager.take_block_copies()
    assert sorted(copy.src_block_ids) == sorted(_held(manager, "a") + _held(manager, "c"))
    assert len(copy.dst_block_ids) == 4 and manager.num_free_blocks == free_before - 4 + 1   # b's last block too
    manager.complete_transfer(copy.ticket, ok=False)              # a failed copy frees what it filled
    assert [block for _, block in manager.take_recalls("a")] == [None, None]
    assert manager.recall_failures == 4
    for rid in ("a", "c"):
        manager.take_recalls(rid)
        manager.free(rid)
    assert manager.num_free_blocks == 16


def test_a_request_freed_while_its_recall_is_in_flight_gets_its_block_back_when_it_lands():
    manager = _manager()
    for rid in ("a", "b"):
        manager.recall(rid, _held(manager, rid)[0])
    (copy,) = manager.take_block_copies()
    manager.free("a")
    manager.complete_transfer(copy.ticket, ok=True)
    assert manager.take_recalls("a") == []
    ((_, block),) = manager.take_recalls("b")
    manager.insert_block("b", 0, block)                          # placed: the table's from now on
    manager.free("b")
    manager.free("c")
    assert manager.num_free_blocks == 16

"""The KV map (Engine.make_kv_map; kvserve/stats.py KVMapSnapshot) of a real engine on a tiny random
model: every block's state before, while and after a request runs, the request and tenant a block
names, prefix trees and pins, the host tier's blocks, and the folding that bounds the payload."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import SamplingParams
from kvserve.engine.engine import Engine
from kvserve.kvcache.kv_map import CACHED, FREE, PINNED, RUNNING, SHARED, fold_cells, heat_scores
from kvserve.stats import KV_BLOCK_STATES

BLOCK = 4
PROMPT = [3 + (7 * i) % 200 for i in range(37)]        # 9 full blocks + 1 token
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-map-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def block_bytes(folder):
    probe = Engine.from_options(model=folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20)
    return probe.kv_bytes_per_token * BLOCK


def _engine(folder: str, block_bytes: int, blocks: int, host_blocks: int = 0, **options) -> Engine:
    extra = dict(kv_host_memory=host_blocks * block_bytes) if host_blocks else {}
    return Engine.from_options(model=folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=blocks * block_bytes,
                               async_scheduling="off", **extra, **options)


def _run(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _counts(tier) -> dict[str, int]:
    return {name: count for name, count in zip(KV_BLOCK_STATES, tier.state_counts) if count}


def test_the_map_follows_a_request_from_running_to_cached(folder, block_bytes):
    engine = _engine(folder, block_bytes, blocks=64)
    gpu = engine.make_kv_map().tiers[0]
    assert (gpu.name, gpu.num_blocks, gpu.blocks_per_cell, len(gpu.states)) == ("gpu", 64, 1, 64)
    assert _counts(gpu) == {"free": 64}

    engine.add_request("r1", {"prompt_token_ids": PROMPT}, PARAMS, tenant="alice")
    engine.step()                                   # the prefill: its full blocks are published
    kv_map = engine.make_kv_map()
    gpu, table = kv_map.tiers[0], engine.kv_manager.block_table("r1")
    [request] = kv_map.requests
    assert (request.request_id, request.state, request.tenant, request.gpu_blocks) == ("r1", "running", "alice", len(table))
    assert kv_map.num_requests == 1 and request.num_prompt_tokens == len(PROMPT)
    assert _counts(gpu) == {"free": 64 - len(table), "shared": 9, "running": len(table) - 9}
    for position, block_id in enumerate(table):
        assert gpu.states[block_id] == (SHARED if position < 9 else RUNNING)
        assert gpu.requests[block_id] == 0 and kv_map.tenants[gpu.tenants[block_id]] == "alice"
        assert gpu.heat[block_id] >= 50                 # held now: one use at least
    assert all(gpu.states[b] == FREE and gpu.requests[b] == -1 for b in set(range(64)) - set(table))

    _run(engine)
    kv_map = engine.make_kv_map()
    gpu = kv_map.tiers[0]
    cached = engine.kv_manager.prefix_cache.num_cached_blocks
    assert kv_map.requests == () and cached == (len(PROMPT) + PARAMS.max_tokens - 1) // BLOCK
    assert _counts(gpu) == {"free": 64 - cached, "cached": cached}
    cached_ids = [b for b in range(64) if gpu.states[b] == CACHED]
    assert all(gpu.requests[b] == -1 and kv_map.tenants[gpu.tenants[b]] == "alice" for b in cached_ids)
    assert all(45 <= gpu.heat[b] <= 50 for b in cached_ids)           # one use, a moment ago
    [tree] = kv_map.prefix_trees
    assert (tree.tenant, tree.num_blocks, tree.max_depth, tree.num_branches, tree.hits) == ("alice", cached, cached - 1, 0, 1)
    assert [(n.parent, n.depth, n.num_blocks, n.held_blocks) for n in tree.nodes] == [(-1, 0, cached, 0)]
    json.dumps(kv_map.as_dict())                    # plain data all the way down


def test_a_second_request_shares_the_prefix_and_branches_the_tree(folder, block_bytes):
    engine = _engine(folder, block_bytes, blocks=64)
    engine.add_request("first", {"prompt_token_ids": PROMPT}, PARAMS)
    _run(engine)
    other = PROMPT[:24] + [201 + i for i in range(13)]         # the first 6 blocks in common
    engine.add_request("second", {"prompt_token_ids": other}, PARAMS)
    engine.step()
    kv_map = engine.make_kv_map()
    gpu = kv_map.tiers[0]
    [request] = kv_map.requests
    assert request.num_cached_tokens == 24
    table = engine.kv_manager.block_table("second")
    assert all(gpu.states[b] == SHARED and gpu.requests[b] == 0 for b in table[:6])
    assert kv_map.tenants[gpu.tenants[table[0]]] is None          # requests without a tenant
    [tree] = kv_map.prefix_trees
    assert tree.held_blocks == 9 and tree.num_branches == 1      # 6 shared + its own 3 full blocks so far
    _run(engine)
    [tree] = engine.make_kv_map().prefix_trees
    root, *branches = tree.nodes
    assert (root.parent, root.depth, root.num_blocks, root.hits) == (-1, 0, 6, 2)
    assert sorted((b.parent, b.depth, b.hits) for b in branches) == [(0, 6, 1), (0, 6, 1)]
    assert tree.num_nodes == 3 and tree.num_blocks == sum(n.num_blocks for n in tree.nodes)
    # Bounded: one segment only, the largest subtree (the root) first.
    [only] = engine.make_kv_map(max_tree_nodes=1).prefix_trees[0].nodes
    assert only == root
    assert engine.make_kv_map(max_trees=0).prefix_trees is None


def test_waiting_requests_are_listed_after_running_ones_and_the_list_is_bounded(folder, block_bytes):
    engine = _engine(folder, block_bytes, blocks=64, max_num_seqs=1)
    engine.add_request("a", {"prompt_token_ids": PROMPT}, PARAMS, tenant="t1")
    engine.add_request("b", {"prompt_token_ids": PROMPT[::-1]}, PARAMS, tenant="t2")
    engine.step()
    kv_map = engine.make_kv_map()
    assert [(r.request_id, r.state, r.gpu_blocks > 0) for r in kv_map.requests] == [("a", "running", True),
                                                                                      ("b", "waiting", False)]
    bounded = engine.make_kv_map(max_requests=1)
    assert [r.request_id for r in bounded.requests] == ["a"] and bounded.num_requests == 2
    _run(engine)


def test_folding_bounds_the_payload_and_keeps_exact_counts(folder, block_bytes):
    engine = _engine(folder, block_bytes, blocks=4096)
    for index in range(6):
        engine.add_request(f"r{index}", {"prompt_token_ids": [5 + index] + PROMPT * 4}, PARAMS, tenant=f"t{index % 2}")
    engine.step()
    engine.step()
    full = engine.make_kv_map(max_cells=1 << 16)
    folded = engine.make_kv_map(max_cells=64)
    whole, cells = full.tiers[0], folded.tiers[0]
    assert whole.blocks_per_cell == 1 and len(whole.states) == 4096
    assert cells.blocks_per_cell == 64 and len(cells.states) == 64 == len(cells.heat) == len(cells.requests)
    assert cells.state_counts == whole.state_counts and sum(cells.state_counts) == 4096
    states, heat = np.array(whole.states), np.array(whole.heat)
    for index in range(64):
        chunk = states[index * 64:(index + 1) * 64]
        counts = np.bincount(chunk, minlength=len(KV_BLOCK_STATES))
        assert cells.states[index] == counts.argmax()                # the majority (ties: the earlier state)
        assert cells.heat[index] == heat[index * 64:(index + 1) * 64].max()
        shown = index * 64 + int(np.argmax(chunk == cells.states[index]))
        assert (cells.requests[index], cells.tenants[index]) == (whole.requests[shown], whole.tenants[shown])
    # The grid's payload follows the cells, not the pool.
    assert len(json.dumps(folded.as_dict()["tiers"])) < min(4096, len(json.dumps(full.as_dict()["tiers"])) / 20)
    _run(engine)


def test_fold_cells_majority_shown_block_and_heat():
    states = np.array([FREE, FREE, CACHED, CACHED, CACHED, RUNNING, RUNNING, FREE])
    heat = np.array([0, 0, 10, 90, 20, 50, 60, 0])
    folded = fold_cells(states, heat, max_cells=3)
    assert folded.blocks_per_cell == 3
    assert folded.states.tolist() == [FREE, CACHED, FREE]          # the last cell: a tie of two, the earlier state
    assert folded.shown.tolist() == [0, 3, 7] and folded.heat.tolist() == [10, 90, 60]
    assert folded.state_counts[FREE] == 3 and folded.state_counts[CACHED] == 3
    assert heat_scores(np.array([0.0, 1.0, 9.0])).tolist() == [0, 50, 90]


def test_pins_and_pinned_blocks_are_shown(folder, block_bytes):
    engine = _engine(folder, block_bytes, blocks=64)
    pin = engine.pin_prefix({"prompt_token_ids": PROMPT}, ttl_s=60, tenant="alice")
    [shown] = engine.make_kv_map().pins
    assert (shown.pin_id, shown.tenant, shown.num_blocks, shown.num_cached_blocks) == (pin.pin_id, "alice", 9, 0)
    assert 0 < shown.expires_in_s <= 60
    engine.add_request("r", {"prompt_token_ids": PROMPT}, PARAMS, tenant="alice")
    _run(engine)
    kv_map = engine.make_kv_map()
    assert kv_map.tiers[0].state_counts[PINNED] == 9 and kv_map.pins[0].num_cached_blocks == 9
    assert kv_map.prefix_trees[0].pinned_blocks == 9
    engine.unpin_prefix(pin.pin_id, tenant="alice")
    kv_map = engine.make_kv_map()
    assert kv_map.pins == () and kv_map.tiers[0].state_counts[PINNED] == 0


def test_the_host_tier_shows_the_blocks_the_gpu_evicted(folder, block_bytes):
    engine = _engine(folder, block_bytes, blocks=16, host_blocks=64)
    engine.add_request("keep", {"prompt_token_ids": PROMPT}, PARAMS, tenant="alice")
    _run(engine)
    for index in range(3):                          # each filler evicts what the one before left cached
        engine.add_request(f"filler{index}", {"prompt_token_ids": [11 + index] * 37}, PARAMS, tenant="bob")
        _run(engine)
    kv_map = engine.make_kv_map()
    gpu, host = kv_map.tiers
    assert (host.name, host.num_blocks, host.blocks_per_cell) == ("host", 64, 1)
    used = engine.kv_manager.host_tier.num_used_blocks
    assert used > 0 and host.state_counts[CACHED] == used and _counts(host) == {"free": 64 - used, "cached": used}
    tenants = {kv_map.tenants[host.tenants[i]] for i in range(64) if host.states[i] == CACHED}
    assert "alice" in tenants
    # The GPU cache's history of an evicted block scores its host copy.
    assert max(host.heat[i] for i in range(64) if host.states[i] == CACHED) >= 40
    assert sum(gpu.state_counts) == 16

"""Engine.make_kv_map: the KV cache block by block (kvserve/stats.py KVMapSnapshot), assembled from
what each owner reports: the scheduler's requests (sched/request_map.py), the KV manager's GPU and
host blocks (KVCacheManager.make_block_maps), the prefix cache's trees and pins. Made on the engine
thread, between steps, only when a reader asks (the dashboard: server/dashboard.py); one pass over
each pool and over the cached blocks."""

from __future__ import annotations

import time

from kvserve.kvcache.kv_map import DEFAULT_MAX_CELLS, TenantIndex, clamp_max_cells
from kvserve.kvcache.manager import KVCacheManager
from kvserve.sched.request_map import DEFAULT_MAX_REQUESTS, make_request_map
from kvserve.sched.scheduler import Scheduler
from kvserve.stats import KVMapSnapshot

DEFAULT_MAX_TREES = 16          # prefix trees listed, the largest first
DEFAULT_MAX_TREE_NODES = 64     # segments drawn per tree


def make_kv_map(manager: KVCacheManager, scheduler: Scheduler, kv_format: str, kv_bytes_per_token: int,
                heat_half_life_s: float, max_cells: int = DEFAULT_MAX_CELLS,
                max_requests: int = DEFAULT_MAX_REQUESTS, max_trees: int = DEFAULT_MAX_TREES,
                max_tree_nodes: int = DEFAULT_MAX_TREE_NODES) -> KVMapSnapshot:
    """kv_format: the blocks' format in words (KVCacheSpec.describe()); heat decays by halves every
    heat_half_life_s. max_trees 0: no prefix trees this time (prefix_trees None), the costlier part
    on a big cache."""
    started = time.perf_counter()
    cache = manager.prefix_cache
    requests, num_requests = make_request_map(scheduler, max_requests)
    tenants = TenantIndex()
    tiers = manager.make_block_maps(requests, tenants, clamp_max_cells(max_cells), kv_format, heat_half_life_s)
    trees, num_trees = None, 0
    if max_trees > 0:
        trees, num_trees = cache.make_prefix_trees(max_trees, max(1, max_tree_nodes)) if cache else ((), 0)
    return KVMapSnapshot(time.time(), time.monotonic(), manager.block_size, kv_bytes_per_token * manager.block_size,
                         cache.policy.label if cache is not None else "off", tiers, tenants.names, requests,
                         num_requests, trees, num_trees, cache.make_pins() if cache is not None else (),
                         time.perf_counter() - started)

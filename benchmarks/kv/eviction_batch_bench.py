"""Host time of one allocation that evicts N cached blocks with write-back to the host tier, one
eviction per block (allocate(1) N times) against one eviction per allocation (allocate(N)), side by
side on the same cache contents. CPU-only bookkeeping: no KV bytes move (the copies are queued)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvserve.kvcache.host_tier import HostTier
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.policies import make_policy
from kvserve.kvcache.prefix_cache import PrefixCache, hash_block, namespace_root

BLOCK = 16


def _filled_manager(num_blocks: int, policy: str) -> KVCacheManager:
    cache = PrefixCache(make_policy(policy), time.monotonic)
    manager = KVCacheManager(num_blocks, BLOCK, cache, HostTier(2 * num_blocks), write_back_min_uses=1)
    parent = namespace_root("")
    blocks = manager.pool.allocate(num_blocks)
    for depth, block in enumerate(blocks):          # one long cached prefix, every block used once
        tokens = [(7 * depth + i) % 30000 for i in range(BLOCK)]
        block_hash = hash_block(parent, tokens)
        assert cache.insert(block, block_hash, parent, tokens, "", depth)
        parent = block_hash
    cache.record_use(blocks)
    manager.pool.free(reversed(blocks))
    return manager


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=2048, help="blocks one allocation evicts (2,048 = a 32k-token prefix)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    one_by_one, batched = [], []
    for _ in range(args.repeats):
        for times, per_call in ((one_by_one, 1), (batched, args.blocks)):
            manager = _filled_manager(args.blocks, args.policy)
            started = time.perf_counter()
            for _ in range(args.blocks // per_call):
                manager.pool.allocate(per_call)
            times.append(time.perf_counter() - started)
            assert manager.host_tier.blocks_written == args.blocks
    results = {"blocks": args.blocks, "policy": args.policy,
               "one_eviction_per_block_ms": 1e3 * min(one_by_one), "one_eviction_per_allocation_ms": 1e3 * min(batched),
               "speedup": min(one_by_one) / min(batched)}
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

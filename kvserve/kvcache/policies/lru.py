"""`lru`: the block used longest ago goes first."""

from __future__ import annotations

from kvserve.kvcache.policies.base import NEVER, AccessStats, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def priority(self, stats: AccessStats) -> float:
        return stats.times[-1] if stats.times else NEVER

    def clone(self) -> "LRUPolicy":
        return LRUPolicy()


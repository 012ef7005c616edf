"""`lfu-age`: LFU with dynamic aging (LFU-DA, Arlitt et al. 2000): priority = age + uses, where the
age becomes the priority of each evicted block, so blocks popular long ago age out."""

from __future__ import annotations

from kvserve.kvcache.policies.base import AccessStats, EvictionPolicy


class LFUAgePolicy(EvictionPolicy):
    name = "lfu-age"

    def __init__(self) -> None:
        self.age = 0.0

    def priority(self, stats: AccessStats) -> float:
        return self.age + stats.count

    def on_evict(self, priority: float) -> None:
        if priority > self.age:
            self.age = priority

    def clone(self) -> "LFUAgePolicy":
        return LFUAgePolicy()

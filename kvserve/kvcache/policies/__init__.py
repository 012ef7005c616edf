"""Eviction policies of the prefix cache: which cached KV block goes first. One file a policy (or a
family); `make_policy` builds the one `--eviction-policy` names. Adding a policy is adding a file,
its name to config.EVICTION_POLICIES, and a branch here."""

from __future__ import annotations

from typing import Optional

from kvserve.config import EVICTION_POLICIES
from kvserve.kvcache.policies.adaptive import AdaptivePolicy, default_arms
from kvserve.kvcache.policies.base import MAX_HISTORY, AccessStats, EvictionPolicy, note_continuation
from kvserve.kvcache.policies.evictor import Evictor
from kvserve.kvcache.policies.heat import FanoutPolicy, LRUKPolicy
from kvserve.kvcache.policies.lfu_age import LFUAgePolicy
from kvserve.kvcache.policies.lru import LRUPolicy

__all__ = ["MAX_HISTORY", "AccessStats", "AdaptivePolicy", "EvictionPolicy", "Evictor",
           "FanoutPolicy", "LFUAgePolicy", "LRUKPolicy", "LRUPolicy", "default_arms", "make_policy",
           "note_continuation"]


def make_policy(name: str, *, lru_k: int = 2, half_life_s: float = 120.0, num_blocks: int = 0,
                adaptive_options: Optional[dict] = None) -> EvictionPolicy:
    """The policy `--eviction-policy NAME` selects (adaptive: over shadow caches of num_blocks)."""
    if name == "lru":
        return LRUPolicy()
    if name == "lru-k":
        return LRUKPolicy(lru_k, half_life_s)
    if name == "lfu-age":
        return LFUAgePolicy()
    if name == "fanout":
        return FanoutPolicy(lru_k, half_life_s)
    if name == "adaptive":
        return AdaptivePolicy(default_arms(lru_k, half_life_s), num_blocks, **(adaptive_options or {}))
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(EVICTION_POLICIES)}")

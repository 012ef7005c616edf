"""The adaptive eviction policy: picks the policy (and its parameters) that would have hit most.

Each candidate ("arm": lru, lfu-age, lru-k at several half-lives, fanout, ...) runs a *shadow
cache*: a ghost cache of block hashes only, with the pool's capacity, fed the same stream of
lookups and releases as the real cache. A shadow's hits are what that arm would have scored on this
traffic, measured on its own cache contents, so every arm is scored every epoch (full information:
the learner never has to gamble real hits to explore, unlike a bandit that switches the real cache
to try an arm). Every `epoch_lookups` lookups the scores are discounted (recent traffic counts
most) and the real cache switches to the best arm if it beats the active one by `switch_margin`
(hysteresis against flapping). A switch re-keys the real cache's evictable blocks under the new
arm; blocks keep their access history, so nothing is lost.

For large pools the shadows are spatially sampled (SHARDS, Waldspurger et al. 2015): only block
hashes below a threshold are simulated, in a shadow scaled down by the same rate, which keeps the
cost per request bounded whatever the pool size.

Decisions are logged (logger `kvserve.prefix_cache`) and exposed through `snapshot()` for /metrics.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Optional

from kvserve.kvcache.policies.base import MAX_HISTORY, AccessStats, EvictionPolicy, note_continuation
from kvserve.kvcache.policies.evictor import Evictor
from kvserve.kvcache.policies.heat import FanoutPolicy, LRUKPolicy
from kvserve.kvcache.policies.lfu_age import LFUAgePolicy
from kvserve.kvcache.policies.lru import LRUPolicy
from kvserve.stats import AdaptivePolicyStats

logger = logging.getLogger("kvserve.prefix_cache")

_HASH_SPACE = 1 << 64


def default_arms(lru_k: int = 2, half_life_s: float = 120.0) -> list[EvictionPolicy]:
    """lru, lfu-age, and lru-k with the configured K over half-lives 1/8x, 1x and 8x the configured
    one, plus a frequency-leaning lru-k (larger K, long half-life), plus fanout with the larger K
    (several recent branches estimate how often new requests share a prefix better than one)."""
    wide_k = min(MAX_HISTORY, max(lru_k + 2, 4))
    return [LRUPolicy(), LFUAgePolicy(),
            LRUKPolicy(lru_k, half_life_s / 8), LRUKPolicy(lru_k, half_life_s), LRUKPolicy(lru_k, half_life_s * 8),
            LRUKPolicy(wide_k, half_life_s * 8), FanoutPolicy(wide_k, half_life_s)]


class ShadowCache:
    """A ghost cache: which block hashes one policy would hold, with no KV behind them."""

    def __init__(self, policy: EvictionPolicy, capacity_blocks: int) -> None:
        self.policy = policy
        self.capacity = max(1, capacity_blocks)
        self._stats: dict[bytes, AccessStats] = {}
        self._history: OrderedDict[bytes, AccessStats] = OrderedDict()   # as PrefixCache keeps (2x)
        self._evictor = Evictor()

    def __len__(self) -> int:
        return len(self._stats)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._stats

    def prefix_hits(self, block_hashes: list[bytes]) -> int:
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self._stats:
                break
            hits += 1
        return hits

    def use(self, block_hashes: list[bytes], depths: list[int], now: float) -> None:
        """One request used these blocks (a prefix chain, or with sampling the sampled blocks of
        one, in order): record the access, insert the missing ones, evict down to capacity."""
        all_stats, priority, add = self._stats, self.policy.priority, self._evictor.add
        track_fanout = self.policy.tracks_fanout
        chain: list[AccessStats] = []
        for block_hash, depth in zip(block_hashes, depths):
            stats = all_stats.get(block_hash)
            if stats is None:
                stats = all_stats[block_hash] = self._history.pop(block_hash, None) or AccessStats(depth)
                # As PrefixCache.insert: a new block under a parent continued differently before
                # is a branch for every ancestor. Only ancestors in this call are seen (a branch
                # inside the generated part of a request, after its prompt, is missed).
                if track_fanout and chain and note_continuation(chain[-1], block_hash):
                    for ancestor in chain:
                        ancestor.branch_pending = True
            chain.append(stats)
        # Recorded after the whole chain is seen, so a branch found deep in it counts in this
        # access of its ancestors, as it does in the real cache.
        for block_hash, stats in zip(block_hashes, chain):
            stats.record(now)
            add(block_hash, priority(stats), stats.depth)
        while len(all_stats) > self.capacity:
            victim, victim_priority = self._evictor.pop()
            self._history[victim] = all_stats.pop(victim)
            if len(self._history) > 2 * self.capacity:
                self._history.popitem(last=False)
            self.policy.on_evict(victim_priority)


@dataclass
class Arm:
    policy: EvictionPolicy        # ranks the real cache's blocks while this arm is active
    shadow: ShadowCache
    score: float = 0.0            # discounted shadow hits (blocks)
    epoch_hits: int = 0

    @property
    def label(self) -> str:
        return self.policy.label


class AdaptivePolicy(EvictionPolicy):
    name = "adaptive"

    def __init__(self, arms: list[EvictionPolicy], num_blocks: int, epoch_lookups: int = 32,
                 discount: float = 0.8, switch_margin: float = 0.01, max_shadow_blocks: int = 16384) -> None:
        if not arms:
            raise ValueError("the adaptive policy needs at least one arm")
        if epoch_lookups < 1 or not 0.0 <= discount < 1.0:
            raise ValueError("epoch_lookups must be >= 1 and discount in [0, 1)")
        self.num_blocks = num_blocks
        self.max_shadow_blocks = max_shadow_blocks
        rate = min(1.0, max_shadow_blocks / max(1, num_blocks))
        self.sample_rate = rate
        self._threshold = _HASH_SPACE if rate >= 1.0 else int(rate * _HASH_SPACE)
        capacity = max(1, round(num_blocks * rate))
        self.arms = [Arm(policy, ShadowCache(policy.clone(), capacity)) for policy in arms]
        self.active = 0
        self.epoch_lookups = epoch_lookups
        self.discount = discount
        self.switch_margin = switch_margin
        self.num_switches = 0
        self.tracks_fanout = any(policy.tracks_fanout for policy in arms)   # any arm may become active
        # Set by the cache: re-key its blocks, and tell whoever records config events (old, new arm).
        self.on_switch: Optional[Callable[[str, str], None]] = None
        self._lookups = 0
        self._queries = 0.0
        self._epoch_queries = 0
        self._decisions: deque[str] = deque(maxlen=16)

    # --- EvictionPolicy: the active arm ranks the real cache ---------------------------------------
    @property
    def current(self) -> EvictionPolicy:
        return self.arms[self.active].policy

    def priority(self, stats: AccessStats) -> float:
        return self.current.priority(stats)

    def on_evict(self, priority: float) -> None:
        self.current.on_evict(priority)

    @property
    def label(self) -> str:
        return self.current.label

    def clone(self) -> "AdaptivePolicy":
        return AdaptivePolicy([arm.policy.clone() for arm in self.arms], self.num_blocks, self.epoch_lookups,
                              self.discount, self.switch_margin, self.max_shadow_blocks)

    # --- learning from the request stream ----------------------------------------------------------
    def _sample(self, block_hashes: list[bytes], first_depth: int) -> tuple[list[bytes], list[int]]:
        if self._threshold >= _HASH_SPACE:
            return block_hashes, list(range(first_depth, first_depth + len(block_hashes)))
        kept, depths = [], []
        for depth, block_hash in enumerate(block_hashes, first_depth):
            if int.from_bytes(block_hash[:8], "little") < self._threshold:
                kept.append(block_hash)
                depths.append(depth)
        return kept, depths

    def observe_lookup(self, block_hashes: list[bytes], now: float) -> None:
        hashes, depths = self._sample(block_hashes, 0)
        self._epoch_queries += len(hashes)
        for arm in self.arms:
            arm.epoch_hits += arm.shadow.prefix_hits(hashes)
            arm.shadow.use(hashes, depths, now)
        self._lookups += 1
        if self._lookups % self.epoch_lookups == 0:
            self._decide()

    def observe_release(self, block_hashes: list[bytes], first_depth: int, now: float) -> None:
        hashes, depths = self._sample(block_hashes, first_depth)
        if hashes:
            for arm in self.arms:
                arm.shadow.use(hashes, depths, now)

    def shadow_hit_rates(self) -> dict[str, float]:
        if self._queries <= 0:
            return {arm.label: 0.0 for arm in self.arms}
        return {arm.label: arm.score / self._queries for arm in self.arms}

    def _decide(self) -> None:
        self._queries = self.discount * self._queries + self._epoch_queries
        self._epoch_queries = 0
        for arm in self.arms:
            arm.score = self.discount * arm.score + arm.epoch_hits
            arm.epoch_hits = 0
        if self._queries <= 0:
            return
        best = max(range(len(self.arms)), key=lambda i: (self.arms[i].score, i == self.active))
        gain = (self.arms[best].score - self.arms[self.active].score) / self._queries
        if best == self.active or gain <= self.switch_margin:
            return
        rates = self.shadow_hit_rates()
        old = self.label
        self.active = best
        self.num_switches += 1
        decision = (f"lookup {self._lookups}: {old} -> {self.label} (shadow hit rates: "
                    + ", ".join(f"{label} {rate:.3f}" for label, rate in rates.items()) + ")")
        self._decisions.append(decision)
        logger.info("adaptive eviction: %s", decision)
        if self.on_switch is not None:
            self.on_switch(old, self.label)

    def snapshot(self) -> AdaptivePolicyStats:
        return AdaptivePolicyStats(self.label, self.num_switches, self.shadow_hit_rates(), tuple(self._decisions))

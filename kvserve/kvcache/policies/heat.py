"""Policies that rank by a block's heat: a few recent accesses, each decaying with a half-life.

- `lru-k`: LRU-K with exponential time decay: the heat of a block's last K accesses,
  sum 2^-(now - t_i)/half_life. With K=2 a block used once ranks below one used twice recently
  (scan resistance); a long half-life tends to frequency (capped at K), a short one to LRU.
  Heats of two blocks keep their order as time passes (both decay by the same factor), which is
  what lets the heap hold them; they are stored as log2 of the undecayed sum.
- `fanout`: lru-k's heat over the newest access and the K-1 latest earlier accesses that opened
  a new *branch* below the block: the request computed a block continuing the prefix of this
  block (or of a descendant) differently from how it had been continued before. Other accesses
  count for recency only. In a multi-turn chat most uses of a block are turns of the one
  conversation that owns it, and how many turns it has had says little about whether it goes on,
  while how often new conversations branch off a prefix (a shared system prompt) says how likely
  the next one is. So a conversation's blocks rank by recency, as under lru, and shared prefixes
  keep lru-k's frequency protection. A branch flags every ancestor, so a block never ranks below
  its descendants and leaves still go first.
"""

from __future__ import annotations

import math
from typing import Iterable

from kvserve.kvcache.policies.base import MAX_HISTORY, NEVER, AccessStats, EvictionPolicy


def log2_heat(newest: float, older: Iterable[float], half_life_s: float) -> float:
    """log2 sum_i 2^(t_i / h) over `newest` and `older`, factored around the newest so nothing
    overflows. Two heats keep their order as time passes (both decay by the same factor)."""
    total = 1.0
    for t in older:
        total += 2.0 ** ((t - newest) / half_life_s)
    return newest / half_life_s + math.log2(total)


class HeatPolicy(EvictionPolicy):
    """A block's heat: its newest access and K-1 earlier ones, each decaying with a half-life. The
    subclasses differ in which earlier accesses count."""

    def __init__(self, k: int = 2, half_life_s: float = 120.0) -> None:
        if not 1 <= k <= MAX_HISTORY:
            raise ValueError(f"{self.name} needs 1 <= K <= {MAX_HISTORY}, got {k}")
        if not half_life_s > 0:
            raise ValueError(f"the heat half-life must be > 0 seconds, got {half_life_s}")
        self.k = k
        self.half_life_s = half_life_s

    @property
    def label(self) -> str:
        return f"{self.name}(k={self.k},h={self.half_life_s:g}s)"

    def clone(self) -> "HeatPolicy":
        return type(self)(self.k, self.half_life_s)


class LRUKPolicy(HeatPolicy):
    name = "lru-k"

    def priority(self, stats: AccessStats) -> float:
        times = stats.times
        if not times:
            return NEVER
        return log2_heat(times[-1], times[max(0, len(times) - self.k):-1], self.half_life_s)


class FanoutPolicy(HeatPolicy):
    """Heat of the newest access and the K-1 latest earlier accesses that opened a branch."""
    name = "fanout"
    tracks_fanout = True

    def priority(self, stats: AccessStats) -> float:
        if not stats.times:
            return NEVER
        older = stats.branches[-(self.k - 1):] if self.k > 1 else ()
        return log2_heat(stats.times[-1], older, self.half_life_s)

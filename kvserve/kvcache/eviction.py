"""Which cached KV block goes first: eviction policies, and the evictor that orders blocks by them.

A cached block is *evictable* while no request holds it (refcount 0). Its rank can only change
when a request uses it, and a request that uses it holds it, so while a block is evictable its
priority is fixed: the evictor keeps evictable blocks in a heap keyed by the priority computed
when the block was released, and never re-sorts (entries of blocks taken back are skipped lazily).

One access = one request using the block, stamped when the request lets go of it (finish,
abort or preemption). All blocks of a request are released at one instant, so ties are common;
they are broken deeper-first (a child block is useless once its parent is gone), then oldest
release first.

Policies are pure functions of a block's `AccessStats` (plus small global state for LFU's age),
so one history per block serves every policy and the adaptive policy can switch between them by
re-keying the heap.

- `lru`: last access time.
- `lru-k`: LRU-K with exponential time decay: the heat of a block's last K accesses,
  sum 2^-(now - t_i)/half_life. With K=2 a block used once ranks below one used twice recently
  (scan resistance); a long half-life tends to frequency (capped at K), a short one to LRU.
  Heats of two blocks keep their order as time passes (both decay by the same factor), which is
  what lets the heap hold them; they are stored as log2 of the undecayed sum.
- `lfu-age`: LFU with dynamic aging (LFU-DA, Arlitt et al. 2000): priority = age + uses, where
  the age becomes the priority of each evicted block, so blocks popular long ago age out.
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

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional

MAX_HISTORY = 8          # access times kept per block: the largest K lru-k may use
_NEVER = -math.inf


@dataclass(slots=True)
class AccessStats:
    """Access history of one cached block (or one shadow-cache entry)."""
    depth: int                                   # index of the block in its prefix chain
    count: int = 0
    times: list[float] = field(default_factory=list)     # the last MAX_HISTORY access times
    # Fan-out, kept only where a policy ranks by it (`EvictionPolicy.tracks_fanout`):
    last_child: Optional[bytes] = None           # hash of the block that last continued this one
    branch_pending: bool = False                 # a request opened a new branch below; its access is due
    newest_branched: bool = False                # the newest access opened a branch
    branches: tuple[float, ...] = ()             # earlier accesses that opened one (last MAX_HISTORY)

    def record(self, now: float) -> None:
        self.count += 1
        times = self.times
        if self.newest_branched:
            # The newest access is about to become an earlier one: keep it as a branch access.
            self.branches = (self.branches + (times[-1],))[-MAX_HISTORY:]
        self.newest_branched, self.branch_pending = self.branch_pending, False
        times.append(now)
        if len(times) > MAX_HISTORY:
            del times[0]


def note_continuation(parent: AccessStats, child: bytes) -> bool:
    """Records that the block `child` continues `parent`'s prefix. True when that opens a new
    branch: the parent was continued by another block before (a first continuation, such as the
    next turn of a conversation, is not a branch; a second conversation on a system prompt is)."""
    previous, parent.last_child = parent.last_child, child
    return previous is not None and previous != child


def _log2_heat(newest: float, older: Iterable[float], half_life_s: float) -> float:
    """log2 sum_i 2^(t_i / h) over `newest` and `older`, factored around the newest so nothing
    overflows. Two heats keep their order as time passes (both decay by the same factor)."""
    total = 1.0
    for t in older:
        total += 2.0 ** ((t - newest) / half_life_s)
    return newest / half_life_s + math.log2(total)


class EvictionPolicy:
    """Lower priority = evicted first. Subclasses set `name` and implement `priority`."""
    name = ""
    tracks_fanout = False        # whether the cache must keep AccessStats' fan-out fields up to date

    def priority(self, stats: AccessStats) -> float:
        raise NotImplementedError

    def on_evict(self, priority: float) -> None:
        """Called with the priority of each evicted block (LFU-DA's aging uses it)."""

    @property
    def label(self) -> str:
        """Name with parameters, used in metrics labels and logs."""
        return self.name

    # Hooks for policies that learn from the request stream (adaptive); no-ops here.
    def observe_lookup(self, block_hashes: list[bytes], now: float) -> None:
        """A request looked up these (prompt) blocks."""

    def observe_release(self, block_hashes: list[bytes], first_depth: int, now: float) -> None:
        """A request released blocks beyond its looked-up prompt (e.g. generated-token blocks)."""

    def clone(self) -> "EvictionPolicy":
        """A fresh instance with the same parameters and no state."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def priority(self, stats: AccessStats) -> float:
        return stats.times[-1] if stats.times else _NEVER

    def clone(self) -> "LRUPolicy":
        return LRUPolicy()


class _HeatPolicy(EvictionPolicy):
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

    def clone(self) -> "_HeatPolicy":
        return type(self)(self.k, self.half_life_s)


class LRUKPolicy(_HeatPolicy):
    name = "lru-k"

    def priority(self, stats: AccessStats) -> float:
        times = stats.times
        if not times:
            return _NEVER
        return _log2_heat(times[-1], times[max(0, len(times) - self.k):-1], self.half_life_s)


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


class FanoutPolicy(_HeatPolicy):
    """Heat of the newest access and the K-1 latest earlier accesses that opened a branch."""
    name = "fanout"
    tracks_fanout = True

    def priority(self, stats: AccessStats) -> float:
        if not stats.times:
            return _NEVER
        older = stats.branches[-(self.k - 1):] if self.k > 1 else ()
        return _log2_heat(stats.times[-1], older, self.half_life_s)


class Evictor:
    """Evictable keys in priority order; pinned keys form a second tier that goes only when the
    first is empty. Keys are block ids (the real cache) or block hashes (shadow caches)."""

    def __init__(self) -> None:
        self._heaps: list[list] = [[], []]                   # unpinned, pinned
        self._live: dict[Hashable, tuple[int, bool]] = {}    # key -> (seq of its live entry, pinned)
        self._seq = itertools.count()
        self._num_pinned = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    def add(self, key: Hashable, priority: float, depth: int, pinned: bool = False) -> None:
        """Adds the key, or re-ranks it if it is already in."""
        live = self._live
        old = live.get(key)
        if old is not None:
            self._num_pinned -= old[1]
        seq = next(self._seq)
        live[key] = (seq, pinned)
        self._num_pinned += pinned
        heap = self._heaps[pinned]
        heapq.heappush(heap, (priority, -depth, seq, key))
        if len(heap) > 64 and len(heap) > 4 * len(live):
            self._compact()

    def remove(self, key: Hashable) -> bool:
        entry = self._live.pop(key, None)
        if entry is None:
            return False
        self._num_pinned -= entry[1]
        return True

    def is_pinned(self, key: Hashable) -> bool:
        entry = self._live.get(key)
        return entry is not None and entry[1]

    def pop(self) -> tuple[Hashable, float]:
        """(key, priority) of the first victim: unpinned tier first."""
        for pinned in (False, True):
            heap = self._heaps[pinned]
            while heap:
                priority, _depth, seq, key = heapq.heappop(heap)
                live = self._live.get(key)
                if live is not None and live[0] == seq:
                    del self._live[key]
                    self._num_pinned -= pinned
                    return key, priority
        raise IndexError("nothing to evict")

    def rebuild(self, entries: Iterable[tuple[Hashable, float, int, bool]]) -> None:
        """Replaces the contents (used when the adaptive policy switches its ranking)."""
        self._heaps = [[], []]
        self._live.clear()
        self._num_pinned = 0
        for key, priority, depth, pinned in entries:
            seq = next(self._seq)
            self._live[key] = (seq, pinned)
            self._num_pinned += pinned
            self._heaps[pinned].append((priority, -depth, seq, key))
        for heap in self._heaps:
            heapq.heapify(heap)

    def _compact(self) -> None:
        # Taken-back and re-ranked keys leave stale entries behind; drop them once they dominate.
        for tier, heap in enumerate(self._heaps):
            kept = [e for e in heap if self._live.get(e[3], (None,))[0] == e[2]]
            heapq.heapify(kept)
            self._heaps[tier] = kept

    def keys(self) -> list[Hashable]:
        return list(self._live)


POLICY_NAMES = ("lru", "lru-k", "lfu-age", "fanout", "adaptive")


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
        from kvserve.kvcache.adaptive import AdaptivePolicy, default_arms
        return AdaptivePolicy(default_arms(lru_k, half_life_s), num_blocks, **(adaptive_options or {}))
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICY_NAMES)}")


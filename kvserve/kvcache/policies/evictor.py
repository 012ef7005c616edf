"""The evictor: evictable blocks in priority order.

A cached block is *evictable* while no request holds it (refcount 0). Its rank can only change when
a request uses it, and a request that uses it holds it, so while a block is evictable its priority
is fixed: the evictor keeps evictable blocks in a heap keyed by the priority computed when the block
was released, and never re-sorts (entries of blocks taken back are skipped lazily).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Hashable, Iterable


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

    def pop_matching(self, wanted: Callable[[Hashable], bool], count: int) -> list[tuple[Hashable, float]]:
        """Up to `count` (key, priority) of the first victims among the keys `wanted` accepts, in
        the order `pop` would take them; the others keep their places."""
        taken: list[tuple[Hashable, float]] = []
        for pinned in (False, True):
            heap, skipped = self._heaps[pinned], []
            while heap and len(taken) < count:
                entry = heapq.heappop(heap)
                priority, _depth, seq, key = entry
                live = self._live.get(key)
                if live is None or live[0] != seq:
                    continue                    # a stale entry
                if wanted(key):
                    del self._live[key]
                    self._num_pinned -= pinned
                    taken.append((key, priority))
                else:
                    skipped.append(entry)
            for entry in skipped:
                heapq.heappush(heap, entry)
        return taken

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

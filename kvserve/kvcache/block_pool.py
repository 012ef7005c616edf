"""Physical KV blocks of one tier: which are free and how many owners each has.

The pool owns reference counts; nobody else keeps a copy. A block with no owner is either
*empty* (in the FIFO queue, content meaningless) or, with prefix caching, *cached*: it keeps its
KV and stays addressable by hash until the prefix cache's eviction policy gives it up. Both count
as free: an allocation takes empty blocks first and evicts cached ones only when none are left.

Each block in use or cached also has the tenant whose request brought it in (its *owner*), so a
tenant's resident KV (running plus cached prefixes) can be held to a quota: `owned` and
`evictable_owned` count them, and `evict_own` frees a tenant's own cached blocks.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, Collection, Iterable, Optional

if TYPE_CHECKING:
    from kvserve.kvcache.prefix_cache import PrefixCache


class BlockPoolError(RuntimeError):
    """A broken invariant (double free, freeing an unknown block): a bug, never a user error."""


class BlockPool:
    def __init__(self, num_blocks: int, cache: Optional["PrefixCache"] = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache = cache
        self._ref_counts = [0] * num_blocks
        # FIFO reuse spreads writes over the pool.
        self._empty: deque[int] = deque(range(num_blocks))
        self._owner: list[Optional[str]] = [None] * num_blocks
        self.owned: Counter[str] = Counter()            # tenant -> its blocks in use or cached
        self.evictable_owned: Counter[str] = Counter()  # tenant -> of those, cached with no owner

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: empty ones plus evictable cached ones."""
        return len(self._empty) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, count: int, owner: Optional[str] = None, avoid: Collection[int] = ()) -> list[int]:
        """`count` blocks: empty ones first, then evicted cached ones. Empty blocks in `avoid` come
        last, after the cache's: a host-tier load into a block the step in flight may still use
        must wait for that step, where one into an evicted block starts at once."""
        if count > self.num_free_blocks:
            raise BlockPoolError(f"asked for {count} blocks with {self.num_free_blocks} free")
        empty = self._empty
        blocks: list[int] = []
        deferred: list[int] = []
        while len(blocks) < count and empty:
            block_id = empty.popleft()
            (deferred if block_id in avoid else blocks).append(block_id)
        from_cache = min(count - len(blocks), self.cache.num_evictable if self.cache is not None else 0)
        if from_cache:                  # the rest from the cache, in one eviction
            evicted = self.cache.evict_many(from_cache)
            self._disown(evicted, evictable=True)
            blocks += evicted
        if deferred:
            used = count - len(blocks)
            blocks += deferred[:used]
            empty.extend(deferred[used:])
        ref_counts, owners = self._ref_counts, self._owner
        for block_id in blocks:
            ref_counts[block_id] = 1
            owners[block_id] = owner
        if owner is not None:
            self.owned[owner] += count
        return blocks

    def evict_own(self, owner: str, count: int, keep: Collection[int] = ()) -> int:
        """Evicts up to `count` of `owner`'s cached blocks (policy order among them, none of `keep`)
        into the empty queue's front, so the owner's next allocation takes them; returns how many."""
        owners = self._owner
        evicted = self.cache.evict_many(
            count, among=lambda block_id: owners[block_id] == owner and block_id not in keep)
        self._disown(evicted, evictable=True)
        self._empty.extendleft(reversed(evicted))
        return len(evicted)

    def owner_of(self, block_id: int) -> Optional[str]:
        return self._owner[block_id]

    def copy_owners(self) -> tuple[list[int], list[Optional[str]]]:
        """Copies of every block's reference count and owning tenant, in block order: what the KV
        map reads (one C-level copy each, where a call per block would cost a pool-sized loop)."""
        return list(self._ref_counts), list(self._owner)

    def _disown(self, blocks: Iterable[int], evictable: bool) -> None:
        owners = self._owner
        for block_id in blocks:
            owner = owners[block_id]
            if owner is not None:
                owners[block_id] = None
                self.owned[owner] -= 1
                if evictable:
                    self.evictable_owned[owner] -= 1

    def share(self, block_id: int) -> None:
        """Adds an owner to a block that is already in use."""
        if self._ref_counts[block_id] < 1:
            raise BlockPoolError(f"block {block_id} is free and cannot be shared")
        self._ref_counts[block_id] += 1

    def acquire_cached(self, block_id: int) -> None:
        """Adds an owner to a cached block (a prefix hit), taking it out of the evictable set."""
        if self.cache is None or not self.cache.holds(block_id):
            raise BlockPoolError(f"block {block_id} is not a cached block")
        if self._ref_counts[block_id] == 0:
            self.cache.on_acquire(block_id)
            owner = self._owner[block_id]
            if owner is not None:
                self.evictable_owned[owner] -= 1
        self._ref_counts[block_id] += 1

    def free(self, blocks: Iterable[int]) -> None:
        # Cached blocks whose last owner left become evictable together, in one call (a long
        # request frees thousands at once).
        released: list[int] = []
        ref_counts, owners, cache = self._ref_counts, self._owner, self.cache
        for block_id in blocks:
            if not 0 <= block_id < self.num_blocks:
                raise BlockPoolError(f"block {block_id} is not in this pool")
            count = ref_counts[block_id]
            if count < 1:
                raise BlockPoolError(f"block {block_id} freed twice")
            ref_counts[block_id] = count - 1
            if count == 1:
                if cache is not None and cache.holds(block_id):
                    released.append(block_id)
                    owner = owners[block_id]
                    if owner is not None:
                        self.evictable_owned[owner] += 1
                else:
                    self._disown((block_id,), evictable=False)
                    self._empty.append(block_id)
        if released:
            cache.on_release_many(released)

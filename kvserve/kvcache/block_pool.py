"""Physical KV blocks of one tier: which are free and how many owners each has.

The pool owns reference counts; nobody else keeps a copy. A block is free exactly when its count
is zero, and then it sits in the free queue once. Later issues (prefix caching) keep freed blocks
addressable until they are evicted; the pool's contract stays the same.
"""

from __future__ import annotations

from collections import deque


class BlockPoolError(RuntimeError):
    """A broken invariant (double free, freeing an unknown block): a bug, never a user error."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # FIFO reuse spreads writes over the pool and keeps recently freed blocks intact longest,
        # which is what a prefix cache will want.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise BlockPoolError(f"asked for {count} blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def share(self, block_id: int) -> None:
        """Adds an owner to a block that is already in use."""
        if self._ref_counts[block_id] < 1:
            raise BlockPoolError(f"block {block_id} is free and cannot be shared")
        self._ref_counts[block_id] += 1

    def free(self, blocks: list[int]) -> None:
        for block_id in blocks:
            if not 0 <= block_id < self.num_blocks:
                raise BlockPoolError(f"block {block_id} is not in this pool")
            count = self._ref_counts[block_id]
            if count < 1:
                raise BlockPoolError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

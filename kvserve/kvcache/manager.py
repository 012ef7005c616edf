"""Request -> block table: which physical blocks hold each request's tokens.

The manager owns block tables; the pool owns refcounts; the scheduler owns request state. Block
tables are append-only while a request runs, so slot numbers handed to a kernel stay valid.
"""

from __future__ import annotations

from kvserve.kvcache.block_pool import BlockPool


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Read-only view for the runner; only the manager changes tables."""
        return self._block_tables

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def num_new_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        have = len(self._block_tables.get(request_id, ()))
        return max(0, blocks_for_tokens(num_total_tokens, self.block_size) - have)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grows the request's table to hold `num_total_tokens`; False (nothing changed) if the pool
        lacks the blocks, so the scheduler can preempt and retry."""
        needed = self.num_new_blocks_needed(request_id, num_total_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        table = self._block_tables.setdefault(request_id, [])
        if needed:
            table.extend(self.pool.allocate(needed))
        return True

    def free(self, request_id: str) -> None:
        table = self._block_tables.pop(request_id, None)
        if table:
            # Freed in reverse so the tail (least likely shared) is reused first.
            self.pool.free(list(reversed(table)))

    @property
    def num_tracked_requests(self) -> int:
        return len(self._block_tables)

"""The host KV tier's accounting: which block of the host store holds which cached prefix block.

Blocks are addressed as in the GPU prefix cache (kvcache/prefix_cache.py): by the chained hash of
their whole prefix in a namespace, with each block's parent hash, tokens and namespace kept and
compared on a hit. A block reaches the host once it is full (write-through) or when the GPU cache
evicts it (write-back). A full block is immutable, so one copy is enough and a block already on the
host is not written again. It comes back into freshly allocated GPU blocks when a later request's prefix continues into it. The bytes
themselves live in a KVCacheStore on the host (kvserve/kvstore/store.py) that the worker registers;
this class only decides which host block each copy reads or writes, and evicts least recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from kvserve.kvcache.kv_map import CACHED, FREE, HELD, OFFLINE
from kvserve.stats import HostTierStats


def default_write_policy(device_type: str, has_cold_tier: bool) -> str:
    """The host tier's write policy when none is configured. Write-through with a tier below (a
    restart or another replica then finds every block) and on CUDA, where a write-back shares the
    link with the load that evicts its blocks (a 32k-token from-host TTFT measured about twice as
    long: docs/kv_tiers.md#write-policies-measured-on-an-h100). Write-back on CPU, where copies run
    on the step itself."""
    return "write-through" if has_cold_tier or device_type == "cuda" else "write-back"


class BlockContent(Protocol):
    """What the tier keys and verifies a block by (a GPU prefix cache's CachedBlock has it)."""
    block_hash: bytes
    parent_hash: bytes
    token_ids: Sequence[int]
    namespace: str


@dataclass(frozen=True)
class HostBlock:
    host_id: int
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    namespace: str


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # Blocks [0, capacity) may be used; memory pressure lowers it (set_capacity).
        self.capacity = num_blocks
        self.blocks_released = 0
        self._free = list(range(num_blocks - 1, -1, -1))
        self._by_hash: OrderedDict[bytes, HostBlock] = OrderedDict()    # least recently used first
        self._hash_of: dict[int, bytes] = {}                             # host id -> its cached block
        # Host blocks a load of this step still has to read: never reused before the step's copies run.
        self._reading: set[int] = set()
        # Host blocks released by swap-ins: free once this step's copies (which read them) are handed on.
        self._release_after_step: list[int] = []
        self.swapped_out = self.swapped_in = self.swap_failures = 0
        self.hit_tokens = 0
        self.blocks_written = 0
        self.blocks_loaded = 0
        self.blocks_evicted = 0
        self.writes_dropped = 0
        self.load_failures = 0
        self.loads_joined = 0       # requests that waited for another's load of the same blocks (KVCacheManager)
        # With tiers below (disk, remote): the blocks written since the engine last took them, so
        # it can copy them on once their bytes have landed (engine/cold_tiers.py).
        self.record_writes = False
        self._new_blocks: list[HostBlock] = []       # stored, their copies not yet handed on
        self._issued_blocks: list[HostBlock] = []    # their copies went with a step's copies

    @property
    def num_used_blocks(self) -> int:
        return len(self._by_hash)

    @property
    def num_free_blocks(self) -> int:
        """Blocks neither cached nor held (by a swapped-out or tiered request)."""
        return len(self._free)

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def store(self, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int], namespace: str,
              from_below: bool = False) -> Optional[int]:
        """The host block to copy an evicted GPU block into, or None: already on the host (one copy
        suffices), or every host block is being read by this step's loads (the write is dropped).
        `from_below`: the bytes come up from a lower tier, which has them already (not recorded)."""
        return self.store_many([HostBlock(-1, block_hash, parent_hash, tuple(token_ids), namespace)], from_below)[0]

    def store_many(self, blocks: Sequence[BlockContent], from_below: bool = False) -> list[Optional[int]]:
        """`store` for each block, in order, in one call (an allocation evicts thousands)."""
        by_hash, hash_of, record = self._by_hash, self._hash_of, self.record_writes and not from_below
        host_ids: list[Optional[int]] = []
        for content in blocks:
            block_hash = content.block_hash
            if block_hash in by_hash:
                by_hash.move_to_end(block_hash)
                host_ids.append(None)
                continue
            host_id = self._take_block()
            if host_id is None:
                self.writes_dropped += 1
                host_ids.append(None)
                continue
            block = HostBlock(host_id, block_hash, content.parent_hash, tuple(content.token_ids), content.namespace)
            by_hash[block_hash] = block
            hash_of[host_id] = block_hash
            if record:
                self._new_blocks.append(block)
            host_ids.append(host_id)
        self.blocks_written += sum(host_id is not None for host_id in host_ids)
        return host_ids

    def take_issued_blocks(self) -> list[HostBlock]:
        """The blocks `store` placed (with `record_writes`) whose copies have been handed to the
        worker with a step's copies (`end_step`) since the last call: issued, maybe not landed."""
        blocks, self._issued_blocks = self._issued_blocks, []
        return blocks

    @property
    def has_unhanded_blocks(self) -> bool:
        """Blocks stored (with `record_writes`) that `take_issued_blocks` has not handed on yet."""
        return bool(self._new_blocks or self._issued_blocks)

    def holds_at(self, host_id: int, block_hash: bytes) -> bool:
        """Whether host block `host_id` still holds the cached block `block_hash` (it was neither
        evicted, forgotten nor reused since it was stored)."""
        return self._hash_of.get(host_id) == block_hash

    def _take_block(self) -> Optional[int]:
        if self._free:
            return self._free.pop()
        for block in self._by_hash.values():
            if block.host_id not in self._reading:
                self._unindex(block.host_id)
                self.blocks_evicted += 1
                return block.host_id
        return None

    def lookup(self, block_hashes: Sequence[bytes], block_tokens: Callable[[int], Sequence[int]], parent: bytes,
               namespace: str, start: int, max_blocks: int) -> list[int]:
        """Host ids of the verified blocks continuing a prefix at block index `start` (at most up to
        index `max_blocks`). Refreshes their recency; nothing is counted until `begin_load`."""
        found: list[int] = []
        for index in range(start, min(max_blocks, len(block_hashes))):
            block = self._by_hash.get(block_hashes[index])
            if (block is None or block.parent_hash != parent or block.namespace != namespace
                    or block.token_ids != tuple(block_tokens(index))):
                break
            self._by_hash.move_to_end(block.block_hash)
            found.append(block.host_id)
            parent = block.block_hash
        return found

    def begin_load(self, host_ids: Sequence[int], block_size: int) -> None:
        """These host blocks are copied to the GPU in this step: held until `end_step`."""
        self._reading.update(host_ids)
        self.blocks_loaded += len(host_ids)
        self.hit_tokens += len(host_ids) * block_size

    def end_step(self) -> None:
        """The step's copies are handed to the worker, which runs them in order before any later write."""
        self._reading.clear()
        self._issued_blocks += self._new_blocks
        self._new_blocks = []
        self._free.extend(self._release_after_step)
        self._release_after_step.clear()

    def forget(self, host_ids: Sequence[int]) -> None:
        """These host blocks do not hold what the index says (their write-back was dropped or
        failed, or a load from them failed): they leave the index and become free."""
        for host_id in host_ids:
            if self._unindex(host_id):
                self._free.append(host_id)

    def _unindex(self, host_id: int) -> bool:
        """Drops the cached block a host block holds from the index; False if it held none."""
        block_hash = self._hash_of.pop(host_id, None)
        if block_hash is None:
            return False
        del self._by_hash[block_hash]
        return True

    def set_capacity(self, target: int, granule: int) -> int:
        """Uses blocks [0, capacity) only, `capacity` the smallest multiple of `granule` (a store
        segment) >= target that keeps every block a swap or this step's loads hold; cached blocks
        above it leave the index, whatever their recency (a later hit recomputes them). Returns it."""
        free = set(self._free)
        # Held by swapped-out requests (neither free nor indexed), or read by this step's loads.
        busy = [host_id for host_id in range(target, self.capacity)
                if host_id in self._reading or (host_id not in self._hash_of and host_id not in free)]
        capacity = min(self.num_blocks, -(-max([target] + [host_id + 1 for host_id in busy]) // granule) * granule)
        if capacity < self.capacity:
            self.blocks_released += sum(self._unindex(host_id) for host_id in range(capacity, self.capacity))
            self._free = [host_id for host_id in self._free if host_id < capacity]
        else:
            self._free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity
        return capacity

    # --- swap preemption: a request's blocks, held outside the index until it resumes ----------------
    def reserve(self, count: int) -> Optional[list[int]]:
        """`count` host blocks for a swapped-out request (free ones first, then least recently used
        cached ones), or None, taking nothing, when the tier cannot spare them."""
        taken = self.hold(count)
        if taken is None:
            self.swap_failures += 1
            return None
        self.swapped_out += 1
        return taken

    def hold(self, count: int) -> Optional[list[int]]:
        """`count` host blocks held outside the index until `release` (a swapped-out request's, or a
        tiered request's demoted blocks), or None, taking nothing, when the tier cannot spare them."""
        taken: list[int] = []
        while len(taken) < count:
            host_id = self._take_block()
            if host_id is None:
                self._free.extend(taken)
                return None
            taken.append(host_id)
        return taken

    def swap_in(self, host_ids: Sequence[int]) -> None:
        """The request's blocks are copied back this step; its host blocks are free after it."""
        self._reading.update(host_ids)
        self._release_after_step.extend(host_ids)
        self.swapped_in += 1

    def release(self, host_ids: Sequence[int]) -> None:
        """Held blocks are no longer needed (a swapped-out request finished without resuming, a
        tiered request ended): free once this step's copies are handed on (a copy of this step may
        still write or read them)."""
        self._release_after_step.extend(host_ids)

    # --- the KV map (kvcache/kv_map.py) -------------------------------------------------------------
    def block_states(self) -> np.ndarray:
        """Each host block's KV-map state: free, cached, offline (above the size memory pressure
        holds the tier to), or else held (for a swapped-out or tiered request, or released this step)."""
        states = np.full(self.num_blocks, HELD, dtype=np.int64)
        states[self.capacity:] = OFFLINE
        if self._free:
            states[np.array(self._free, dtype=np.int64)] = FREE
        if self._hash_of:
            states[np.fromiter(self._hash_of.keys(), dtype=np.int64, count=len(self._hash_of))] = CACHED
        return states

    def cached_at(self, host_id: int) -> Optional[HostBlock]:
        """The cached block host block `host_id` holds (None: it holds none)."""
        block_hash = self._hash_of.get(host_id)
        return self._by_hash[block_hash] if block_hash is not None else None

    def make_stats(self) -> HostTierStats:
        return HostTierStats(self.capacity, self.num_used_blocks, self.hit_tokens, self.blocks_written,
                             self.blocks_loaded, self.blocks_evicted, self.writes_dropped, self.swapped_out,
                             self.swapped_in, self.swap_failures, self.load_failures,
                             self.num_blocks, self.blocks_released, self.loads_joined)

"""Request -> block table: which physical blocks hold each request's tokens.

The manager owns block tables; the pool owns refcounts; the scheduler owns request state. Block
tables are append-only while a request runs, so slot numbers handed to a kernel stay valid.

With prefix caching, a table starts with the cached blocks of the request's longest cached
prefix (`find_cached_prefix`, then `allocate_slots(..., prefix=...)`), and every block that
becomes full of computed tokens is published to the cache (`cache_full_blocks`, after each step)
so later requests can hit it. A request never writes into a block it got from the cache: hits are
whole blocks and the request's computation starts right after them.

With a host tier (kvcache/host_tier.py), a cached block the GPU cache evicts is first copied to the
host, and a prefix lookup that ends in the GPU cache continues in the host tier: those blocks are
copied into freshly allocated GPU blocks. The copies are block copies of the step
(`take_block_copies`), which the worker issues before the step's forward (kvserve/worker/
kv_transfer.py): a write-back reads its block before the block's new owner overwrites it, and a
load or swap-in carries a ticket. Until the worker reports the ticket landed (`complete_transfer`)
the request is loading: the scheduler does not run it, and its table is not freed (an abort frees
it when the copy has landed), so no other request's KV is written into blocks a copy still fills.

Tiering (engine/kv_tiering.py) moves a running request's blocks between its table and host blocks
it holds: `copy_to_host` copies blocks to host blocks held until the request is freed, `demote`
drops blocks from the table (the rest keep their order; attention does not care where a block
sits, RoPE is in the keys), and `recall` copies a held host block into a fresh GPU block while the
request keeps running; once it has landed (`take_recalls`) the engine places it in the table
(`insert_block`, `replace_block`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.host_tier import HostTier
from kvserve.kvcache.prefix_cache import (CachedBlock, HashedSequence, Pin, PrefixCache, chain_hashes,
                                          namespace_root)
from kvserve.kvstore import DEVICE_STORE, HOST_STORE, LOAD, SWAP_IN, SWAP_OUT, WRITE_BACK, BlockCopy
from kvserve.kvcache.kv_map import (CACHED, FREE, LOADING, PINNED, RUNNING, SHARED, fold_cells, heat_scores,
                                    make_tier, namespace_tenant)
from kvserve.stats import KVCacheStats, KVMapRequest, KVMapTier


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class PrefixHit:
    """The result of a lookup: cached blocks to start the request's table with."""
    block_ids: list[int] = field(default_factory=list)        # GPU blocks
    num_tokens: int = 0                 # (len(block_ids) + len(host_block_ids) + len(tail_block_ids)) * block_size
    num_query_tokens: int = 0           # tokens the lookup was for (hit-rate denominator)
    num_query_blocks: int = 0           # full blocks of those tokens (hashes computed)
    host_block_ids: list[int] = field(default_factory=list)   # the host blocks that continue it
    # GPU blocks cached after the host stretch (GPU, then host, then GPU again: the host holds a
    # stretch the GPU evicted from the middle of a prefix): taken as hits after the loaded blocks.
    tail_block_ids: list[int] = field(default_factory=list)

    @property
    def gpu_block_ids(self) -> list[int]:
        """Every GPU block the hit takes as it is (before and after the host stretch)."""
        return self.block_ids + self.tail_block_ids


@dataclass
class _Transfer:
    """A ticketed copy in flight: whose it is and which host blocks it reads or writes."""
    request_id: str
    purpose: str
    host_ids: list[int]


# A ticketed copy that brings a tiered request's demoted block back while the request keeps running.
RECALL = "recall"


@dataclass(frozen=True)
class BlockIdentity:
    """A full GPU block and the cached content it holds: what a copy to the host tier needs
    (a CachedBlock has the same fields)."""
    block_id: int
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    namespace: str


@dataclass
class _CacheState:
    """Per-request prefix-cache bookkeeping, dropped when the request's table is freed."""
    sequence: HashedSequence
    num_published: int = 0              # leading table blocks already offered to the cache
    num_looked_up: int = 0              # blocks the admission lookup reported to the policy
    # Leading table blocks that were GPU hits or loads from the host tier: the host already holds
    # those, so write-through does not copy them back (a 32k-token load publishes 2,048 blocks).
    num_from_cache: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: Optional[PrefixCache] = None,
                 host_tier: Optional[HostTier] = None, write_through: bool = False,
                 write_back_min_uses: int = 1) -> None:
        if host_tier is not None and prefix_cache is None:
            raise ValueError("a host KV tier needs prefix caching (it keeps the blocks the prefix cache evicts)")
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.host_tier = host_tier
        # Write-through: a block goes to the host once it is full (and published), not when evicted.
        self.write_through = write_through and host_tier is not None
        # Selective: an evicted block is copied only if this many requests used it.
        self.write_back_min_uses = write_back_min_uses
        self.pool = BlockPool(num_blocks, prefix_cache)
        # Tenant -> GPU blocks it may hold resident (running plus cached; the scheduler sets them
        # from --qos-config). At its quota a tenant's allocations evict its own cached blocks, and
        # when it has none left to evict they fail: it waits, and no one else's prefix goes for it.
        self.tenant_kv_quotas: dict[str, int] = {}
        self._tenant_of: dict[str, str] = {}
        self._block_tables: dict[str, list[int]] = {}
        self._cache_states: dict[str, _CacheState] = {}
        # This step's copies as runs: (source, destination, purpose, ticket, source ids, destination ids).
        self._pending_copies: list[tuple[str, str, str, Optional[int], list[int], list[int]]] = []
        # Ticketed copies in flight, the tickets of loading requests, and the tables of requests
        # freed while loading (freed when their copy lands).
        self._transfers: dict[int, _Transfer] = {}
        self._loading: dict[str, int] = {}
        self._orphaned: dict[int, list[int]] = {}
        self._next_ticket = 0
        # Loads of at most this many blocks run in the step that admits their request (its forward
        # waits for them on the device) instead of holding the request back until they land: a
        # small load costs the step less than the step or two its request would wait
        # (--kv-host-inline-load-ms; the engine sets it from the measured link rate). `_inline`: such
        # inline loads' tickets, in flight.
        self.inline_load_max_blocks = 0
        self.inline_loads_when_idle = False
        self._inline: set[int] = set()
        # Host blocks a request is bringing in (loading, or landed and not yet published to the GPU
        # cache) -> that request, and each such request's host ids. Another request whose hit
        # reaches them waits for that one to publish them (a GPU hit then) rather than loading
        # the same blocks a second time over the link into blocks of its own.
        self._incoming: dict[int, str] = {}
        self._incoming_of: dict[str, list[int]] = {}
        self._waiting_for_incoming: set[str] = set()
        # GPU blocks freed or published since the last step's copies were taken: the step in flight
        # may still write or read them, so a load into one (or a write-back gathering one) waits for it.
        self._touched: set[int] = set()
        # This step's evicted blocks written back -> their depth in their prefix chains (BlockCopy.depths).
        self._write_back_depths: dict[int, int] = {}
        # Swapped-out requests: their host blocks (in table order) and prefix-cache state.
        self._swapped: dict[str, tuple[list[int], Optional[_CacheState]]] = {}
        # Tiering: host blocks each request holds, recalls in flight (recall id -> request, GPU
        # block, the copy's ticket) and landed ones not yet placed (request -> (recall id, GPU
        # block or None if it failed)). One copy carries every recall queued in a row (a ranking
        # step recalls a few blocks for each of many requests): `_recall_batch` is its ticket
        # while it is the last pending copy, `_batch_recalls` its recall ids.
        self._tier_host_ids: dict[str, set[int]] = {}
        self._recalling: dict[int, tuple[str, int, int]] = {}
        self._recalled: dict[str, list[tuple[int, Optional[int]]]] = {}
        self._recall_batch: Optional[int] = None
        self._batch_recalls: dict[int, list[int]] = {}
        self._next_recall = 0
        self.recall_failures = 0
        if host_tier is not None:
            prefix_cache.on_evict = self._write_back

    # --- the host tier -----------------------------------------------------------------------------
    def _write_back(self, evicted: list[CachedBlock]) -> None:
        # Not `_touched`: a cached block nobody held when the step in flight was issued is not in
        # its batch (one freed since is in `_touched` already), so a load into it starts at once.
        min_uses = self.write_back_min_uses
        kept = [cached for cached in evicted if cached.stats.count >= min_uses]
        self._write_back_depths.update((cached.block_id, cached.stats.depth) for cached in kept)
        self._copy_to_host(kept)

    def _copy_to_host(self, blocks: Sequence[BlockIdentity | CachedBlock]) -> None:
        """Queues the blocks' copies to the host tier (one run), except those the host already
        holds (a full block never changes: one copy is enough)."""
        if not blocks:
            return
        host_ids = self.host_tier.store_many(blocks)
        src_ids = [block.block_id for block, host_id in zip(blocks, host_ids) if host_id is not None]
        if src_ids:
            self._queue_copies(DEVICE_STORE, HOST_STORE, src_ids, [host_id for host_id in host_ids if host_id is not None])

    def _queue_copies(self, source: str, destination: str, src_ids: Sequence[int], dst_ids: Sequence[int],
                      purpose: str = WRITE_BACK, ticket: Optional[int] = None) -> None:
        """Appends to this step's copies; an untracked copy of the same kind as the last run joins it."""
        last = self._pending_copies[-1] if self._pending_copies else None
        if ticket is None and last is not None and last[:4] == (source, destination, purpose, None):
            last[4].extend(src_ids)
            last[5].extend(dst_ids)
        else:
            self._pending_copies.append((source, destination, purpose, ticket, list(src_ids), list(dst_ids)))

    def _new_ticket(self, request_id: str, purpose: str, host_ids: list[int], inline: bool = False) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        self._transfers[ticket] = _Transfer(request_id, purpose, host_ids)
        if inline:
            self._inline.add(ticket)
        elif purpose not in (SWAP_OUT, RECALL):
            self._loading[request_id] = ticket
        return ticket

    def _runs_inline(self, num_blocks: int, any_size: bool) -> bool:
        return (any_size and self.inline_loads_when_idle) or num_blocks <= self.inline_load_max_blocks

    def take_back_inline(self, ticket: int) -> Optional[str]:
        """An inline load that failed as it was issued (its step has not run): its request is held
        back as a loading one, so the ticket's failure report sends it to recompute like any failed
        load. Returns the request's id (None: not an inline ticket in flight)."""
        if ticket not in self._inline:
            return None
        self._inline.discard(ticket)
        request_id = self._transfers[ticket].request_id
        self._loading[request_id] = ticket
        return request_id

    def is_loading(self, request_id: str) -> bool:
        """Its blocks are being copied in from a tier: it may not run, and its table stays put."""
        return request_id in self._loading

    def complete_transfer(self, ticket: int, ok: bool) -> Optional[str]:
        """The worker reports a ticketed copy landed (`ok`) or failed. Returns the id of the request
        that must now recompute what the copy was to bring (a failed load or swap-in, or a failed
        swap-out of a request still waiting), else None. A landed load's blocks join the prefix cache."""
        transfer = self._transfers.pop(ticket, None)
        if transfer is None:
            return None
        self._inline.discard(ticket)
        request_id = transfer.request_id
        if self._loading.get(request_id) == ticket:
            del self._loading[request_id]
        orphan = self._orphaned.pop(ticket, None)
        if orphan is not None:          # freed while loading: its blocks are safe to reuse now
            self._touched.update(orphan)
            self.pool.free(reversed(orphan))
            if transfer.purpose != RECALL:
                return None
        if transfer.purpose == RECALL:
            for recall_id in self._batch_recalls.pop(ticket, []):
                recalling = self._recalling.pop(recall_id, None)
                if recalling is None:
                    continue            # its request was freed (its block was orphaned above)
                owner, block_id, _ = recalling
                if not ok:
                    self.recall_failures += 1
                    self._touched.add(block_id)
                    self.pool.free([block_id])
                self._recalled.setdefault(owner, []).append((recall_id, block_id if ok else None))
            return None             # the requests ran on without the blocks; they still may
        if ok:
            return None
        self.host_tier.load_failures += 1
        if transfer.purpose == SWAP_OUT:
            swapped = self._swapped.pop(request_id, None)
            if swapped is None:
                return None
            self.host_tier.release(swapped[0])
            return request_id
        if transfer.purpose == LOAD:
            self.host_tier.forget(transfer.host_ids)     # what they hold is in doubt: never hit again
        self.free(request_id)
        return request_id

    def forget_host_blocks(self, host_ids: Sequence[int]) -> None:
        """Host blocks a write-back did not fill (dropped under back-pressure, or failed)."""
        if self.host_tier is not None:
            self.host_tier.forget(host_ids)

    def waits_for_incoming(self, request_id: str, prefix: Optional[PrefixHit]) -> bool:
        """True if `prefix` reaches host blocks another request is bringing in: `request_id` should
        wait for them to be published (counted once per request in HostTierStats.loads_joined)."""
        if prefix is None or not prefix.host_block_ids or not self._incoming:
            return False
        incoming = self._incoming
        if not any(incoming.get(host_id, request_id) != request_id for host_id in prefix.host_block_ids):
            return False
        if request_id not in self._waiting_for_incoming:
            self._waiting_for_incoming.add(request_id)
            self.host_tier.loads_joined += 1
        return True

    def _end_incoming(self, request_id: str) -> None:
        for host_id in self._incoming_of.pop(request_id, ()):
            if self._incoming.get(host_id) == request_id:
                del self._incoming[host_id]

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def swap_out(self, request_id: str) -> bool:
        """Copies the request's blocks to the host tier and frees them on the GPU; False (nothing
        changed) without a host tier or room in it. The copies run before the step's forward, so
        they read the blocks before anyone else's KV lands in them."""
        table = self._block_tables.get(request_id)
        if self.host_tier is None or not table or request_id in self._tier_host_ids:
            return False            # a tiered request's table is not all of its KV: it recomputes
        host_ids = self.host_tier.reserve(len(table))
        if host_ids is None:
            return False
        self._queue_copies(DEVICE_STORE, HOST_STORE, table, host_ids, SWAP_OUT,
                           self._new_ticket(request_id, SWAP_OUT, host_ids))
        state = self._cache_states.get(request_id)
        self.free(request_id)
        self._swapped[request_id] = (host_ids, state)
        return True

    def _swap_in(self, request_id: str, num_total_tokens: int, tenant: Optional[str],
                 inline_any_load: bool = False) -> bool:
        host_ids, state = self._swapped[request_id]
        needed = blocks_for_tokens(num_total_tokens, self.block_size)
        if needed > self.pool.num_free_blocks or not self._make_quota_room(tenant, needed, ()):
            return False
        del self._swapped[request_id]
        self.host_tier.swap_in(host_ids)        # held before allocating: write-backs must not take them
        table = self._block_tables[request_id] = self.pool.allocate(needed, tenant, avoid=self._touched)
        self._queue_copies(HOST_STORE, DEVICE_STORE, host_ids, table[:len(host_ids)], SWAP_IN,
                           self._new_ticket(request_id, SWAP_IN, host_ids, self._runs_inline(len(host_ids), inline_any_load)))
        if state is not None:
            self._cache_states[request_id] = state
        return True

    @property
    def has_pending_copies(self) -> bool:
        """Copies queued since the last `take_block_copies` (an idle engine still owes them)."""
        return bool(self._pending_copies)

    def take_block_copies(self) -> list[BlockCopy]:
        """The copies this step's allocations need, in the order they must run."""
        depths = self._write_back_depths
        copies = [BlockCopy(source, destination, tuple(src), tuple(dst), purpose, ticket,
                            after_inflight=not self._touched.isdisjoint(dst if destination == DEVICE_STORE else src),
                            depths=tuple(depths.get(block_id, 0) for block_id in src) if purpose == WRITE_BACK else (),
                            inline=ticket in self._inline)
                  for source, destination, purpose, ticket, src, dst in self._pending_copies]
        self._pending_copies = []
        self._write_back_depths = {}
        self._recall_batch = None
        self._touched = set()
        if self.host_tier is not None:
            self.host_tier.end_step()
        return copies

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Empty plus evictable cached blocks."""
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

    def num_new_blocks_needed(self, request_id: str, num_total_tokens: int, prefix: Optional[PrefixHit] = None) -> int:
        """Blocks an allocation would take from the free pool: new ones, plus cached hits that are
        evictable now (they count as free but stop being free once the request holds them)."""
        have = len(self._block_tables.get(request_id, ()))
        gpu_hits = prefix.gpu_block_ids if prefix is not None and not have else []
        if gpu_hits:
            reused = sum(1 for b in gpu_hits if self.pool.ref_count(b) == 0)
            return max(0, blocks_for_tokens(num_total_tokens, self.block_size) - len(gpu_hits)) + reused
        return max(0, blocks_for_tokens(num_total_tokens, self.block_size) - have)

    # --- prefix cache -------------------------------------------------------------------------------
    def _extend_hashes(self, seq: HashedSequence, num_blocks: int) -> None:
        hashes = seq.block_hashes
        if len(hashes) >= num_blocks:
            return
        bs = self.block_size
        parent = hashes[-1] if hashes else seq.cache_root
        hashes.extend(chain_hashes(parent, seq.token_ids_between(len(hashes) * bs, num_blocks * bs), bs))

    def peek_cached_tokens(self, token_ids: Sequence[int], namespace: str) -> int:
        """Tokens of the longest cached prefix of `token_ids` in `namespace` (whole blocks, the last
        token left to compute), as PrefixCache.peek estimates it: safe from another thread."""
        if self.prefix_cache is None or not token_ids:
            return 0
        bs = self.block_size
        return bs * self.prefix_cache.peek(namespace_root(namespace), namespace, token_ids, bs,
                                           (len(token_ids) - 1) // bs)

    def make_stats(self) -> KVCacheStats:
        host = self.host_tier.make_stats() if self.host_tier is not None else None
        return KVCacheStats(self.num_blocks, self.num_free_blocks, float(self.usage), self.capacity_tokens, host)

    # --- the KV map (kvcache/kv_map.py; Engine.make_kv_map) -----------------------------------------
    def host_blocks_of(self, request_id: str) -> int:
        """Host blocks held for the request: its swapped-out table, or its tiered (demoted) KV."""
        swapped = self._swapped.get(request_id)
        return (len(swapped[0]) if swapped is not None else 0) + len(self._tier_host_ids.get(request_id, ()))

    def make_block_maps(self, listed: Sequence[KVMapRequest], tenant_index: Callable[[Optional[str]], int],
                        max_cells: int, kv_format: str, half_life_s: float) -> tuple[KVMapTier, ...]:
        """The GPU pool's blocks and the host tier's as KV-map tiers of at most `max_cells` cells
        (kvcache/kv_map.py). A GPU block's heat is its recent uses (PrefixCache.block_uses, halving
        every `half_life_s`) plus the requests holding it now; its tenant is the pool's owner. A cell
        names the first of the `listed` requests whose table (or held host blocks) has the block it
        shows. Host cells score the block they show by the GPU cache's history of it (the tier keeps
        none of its own) and name its namespace's tenant."""
        position = {request.request_id: index for index, request in enumerate(listed)}
        refs_list, owners = self.pool.copy_owners()
        refs = np.array(refs_list, dtype=np.int64)
        states = np.where(refs > 0, RUNNING, FREE)
        recent = refs.astype(np.float64)
        cache = self.prefix_cache
        now = cache.clock() if cache is not None else 0.0
        if cache is not None:
            ids, uses, pinned = cache.block_uses(now, half_life_s)
            states[ids] = np.where(refs[ids] > 0, SHARED, CACHED)
            recent[ids] += uses
            states[np.array(pinned, dtype=np.int64)] = PINNED
        holder: dict[int, int] = {}
        for request_id, table in self._block_tables.items():
            if request_id not in position:
                holder.update(dict.fromkeys(table, -1))
        for request in reversed(listed):            # a shared block names the first listed holder
            holder.update(dict.fromkeys(self._block_tables.get(request.request_id, ()), position[request.request_id]))
        loading = [block_id for request_id in self._loading for block_id in self._block_tables.get(request_id, ())]
        if loading:
            loading_ids = np.array(loading, dtype=np.int64)
            # The blocks it waits to have filled (and the rest of its table); its prefix hits stay shared.
            states[loading_ids] = np.where(states[loading_ids] == RUNNING, LOADING, states[loading_ids])
        gpu = make_tier("gpu", len(refs), fold_cells(states, heat_scores(recent), max_cells), kv_format,
                        lambda block_id: (holder.get(block_id, -1), tenant_index(owners[block_id])))
        if self.host_tier is None:
            return (gpu,)
        host_holders: dict[int, tuple[int, int]] = {}
        for index, request in enumerate(listed):
            swapped = self._swapped.get(request.request_id)
            held = list(swapped[0]) if swapped is not None else []
            held += self._tier_host_ids.get(request.request_id, ())
            for host_id in held:
                host_holders.setdefault(host_id, (index, tenant_index(request.tenant)))
        host_states = self.host_tier.block_states()
        folded = fold_cells(host_states, np.zeros(len(host_states), dtype=np.int64), max_cells)
        shown = [self.host_tier.cached_at(host_id) for host_id in folded.shown.tolist()]
        folded.heat = heat_scores([cache.uses_of(block.block_hash, now, half_life_s) if block is not None else 0.0
                                   for block in shown])
        tenant_of = {host_id: tenant_index(namespace_tenant(block.namespace))
                     for host_id, block in zip(folded.shown.tolist(), shown) if block is not None}
        return gpu, make_tier("host", len(host_states), folded, kv_format,
                              lambda host_id: host_holders.get(host_id, (-1, tenant_of.get(host_id, -1))))

    def find_cached_prefix(self, seq: HashedSequence) -> PrefixHit:
        """Longest cached prefix of the sequence's tokens, in whole blocks, leaving at least the
        last token to compute (the step that computes it produces the next token's logits). No
        side effects besides hashing the sequence's full blocks."""
        num_tokens = seq.num_tokens
        num_full = num_tokens // self.block_size
        if self.prefix_cache is None:
            return PrefixHit(num_query_tokens=num_tokens, num_query_blocks=num_full)
        self._extend_hashes(seq, num_full)
        bs = self.block_size
        max_blocks = (num_tokens - 1) // bs
        tokens = lambda i: seq.token_ids_between(i * bs, (i + 1) * bs)  # noqa: E731
        blocks = self.prefix_cache.lookup(seq.block_hashes, tokens, seq.cache_root, seq.cache_namespace, max_blocks)
        host: list[int] = []
        tail: list[int] = []
        if self.host_tier is not None and len(blocks) < max_blocks:
            parent = seq.block_hashes[len(blocks) - 1] if blocks else seq.cache_root
            host = self.host_tier.lookup(seq.block_hashes, tokens, parent, seq.cache_namespace, len(blocks), max_blocks)
            # The host also holds blocks the GPU cache still has (write-through copies every full
            # block): the stretch ends where the GPU has the prefix again, so those are not loaded.
            for offset in range(1, len(host)):
                index = len(blocks) + offset
                if self.prefix_cache.lookup(seq.block_hashes, tokens, seq.block_hashes[index - 1],
                                            seq.cache_namespace, index + 1, start=index):
                    host = host[:offset]
                    break
            after = len(blocks) + len(host)
            if host and after < max_blocks:
                tail = self.prefix_cache.lookup(seq.block_hashes, tokens, seq.block_hashes[after - 1],
                                                seq.cache_namespace, max_blocks, start=after)
        return PrefixHit(blocks, (len(blocks) + len(host) + len(tail)) * bs, num_tokens, num_full, host, tail)

    def cache_full_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Publishes the request's blocks that are now full of computed tokens."""
        state = self._cache_states.get(request_id)
        table = self._block_tables.get(request_id)
        if state is None or table is None:
            return
        end = min(num_computed_tokens // self.block_size, len(table))
        if end <= state.num_published:
            return
        seq, bs = state.sequence, self.block_size
        self._extend_hashes(seq, end)
        hashes = seq.block_hashes
        written: list[BlockIdentity] = []
        from_cache = state.num_from_cache
        for index in range(state.num_published, end):
            parent = hashes[index - 1] if index else seq.cache_root
            tokens = seq.token_ids_between(index * bs, (index + 1) * bs)
            self._touched.add(table[index])
            inserted = self.prefix_cache.insert(table[index], hashes[index], parent, tokens, seq.cache_namespace, index)
            if inserted and self.write_through and index >= from_cache:
                written.append(BlockIdentity(table[index], hashes[index], parent, tuple(tokens), seq.cache_namespace))
        self._copy_to_host(written)
        state.num_published = end
        if end >= from_cache:
            self._end_incoming(request_id)      # its loaded blocks are GPU hits now

    def pin_prefix(self, token_ids: Sequence[int], namespace: str, ttl_s: float) -> tuple[Pin, int]:
        """Pins the full blocks of `token_ids` in `namespace` (cached now or when computed later).
        Returns (pin, number of those blocks cached now)."""
        if self.prefix_cache is None:
            raise ValueError("prefix caching is off: nothing to pin")
        hashes = chain_hashes(namespace_root(namespace), token_ids, self.block_size)
        if not hashes:
            raise ValueError(f"a pinned prefix needs at least one full block ({self.block_size} tokens), "
                             f"got {len(token_ids)} tokens")
        pin = self.prefix_cache.pin(hashes, namespace, ttl_s)
        return pin, self.prefix_cache.num_cached_of(hashes)

    # --- allocation ---------------------------------------------------------------------------------
    def _quota_excess(self, tenant: Optional[str], needed: int) -> int:
        """Blocks by which `needed` more would put `tenant` over its KV quota as things stand."""
        quota = self.tenant_kv_quotas.get(tenant) if tenant is not None else None
        return 0 if quota is None else max(0, self.pool.owned[tenant] + needed - quota)

    def quota_shortfall(self, tenant: Optional[str], needed: int, keep: Sequence[int] = ()) -> int:
        """Blocks by which `needed` more would put `tenant` over its KV quota once it has evicted
        all its own cached blocks (except `keep`: a prefix hit about to be taken); 0 if they fit."""
        over = self._quota_excess(tenant, needed)
        if over == 0:
            return 0
        pool = self.pool
        kept_own = sum(1 for block_id in keep if pool.ref_count(block_id) == 0 and pool.owner_of(block_id) == tenant)
        return max(0, over - (pool.evictable_owned[tenant] - kept_own))

    def kv_blocks_of(self, tenant: str) -> int:
        """GPU blocks the tenant's requests brought in that are still resident (running or cached)."""
        return self.pool.owned[tenant]

    def allocate_slots(self, request_id: str, num_total_tokens: int, prefix: Optional[PrefixHit] = None,
                       sequence: Optional[HashedSequence] = None, tenant: Optional[str] = None,
                       inline_any_load: bool = False) -> bool:
        """Grows the request's table to hold `num_total_tokens`; False (nothing changed) if the pool
        lacks the blocks, or its `tenant` would go over its KV quota (`quota_shortfall`), so the
        scheduler can preempt and retry. A first allocation may start the table with a prefix hit,
        and with `sequence` (a prefix-cache-enabled request) the request's full blocks are
        published to the cache as they are computed. A load from the host this starts runs inline
        in the step (`inline_load_max_blocks`; any size with `inline_any_load`: nothing else runs), or makes
        the request a loading one (`is_loading`)."""
        if tenant is None:
            tenant = self._tenant_of.get(request_id)
        if request_id in self._swapped:
            return self._swap_in(request_id, num_total_tokens, tenant, inline_any_load)
        table = self._block_tables.get(request_id)
        if table is not None:
            prefix = None       # hits only start a table
        needed = self.num_new_blocks_needed(request_id, num_total_tokens, prefix)
        if needed > self.pool.num_free_blocks:
            return False
        if not self._make_quota_room(tenant, needed, prefix.gpu_block_ids if prefix is not None else ()):
            return False
        if tenant is not None:
            self._tenant_of[request_id] = tenant
        self._waiting_for_incoming.discard(request_id)
        if table is None:
            table = self._block_tables[request_id] = []
            if prefix is not None and prefix.block_ids:
                for block_id in prefix.block_ids:
                    self.pool.acquire_cached(block_id)
                table.extend(prefix.block_ids)
            num_device_hits = len(table)
            if prefix is not None and prefix.host_block_ids:
                # The tail is held before the load allocates: it must not be evicted to make room.
                for block_id in prefix.tail_block_ids:
                    self.pool.acquire_cached(block_id)
                self._load_from_host(request_id, prefix.host_block_ids, table, tenant, inline_any_load)
                table.extend(prefix.tail_block_ids)
            if self.prefix_cache is not None and sequence is not None:
                # Loaded blocks are published to the GPU cache like computed ones, after the step.
                state = self._cache_states[request_id] = _CacheState(sequence, num_published=num_device_hits,
                                                                     num_from_cache=len(table))
                if prefix is not None:
                    self.prefix_cache.record_query(
                        prefix.num_query_tokens, (num_device_hits + len(prefix.tail_block_ids)) * self.block_size)
                    state.num_looked_up = prefix.num_query_blocks
                    self.prefix_cache.observe_lookup(sequence.block_hashes[:prefix.num_query_blocks])
        new = blocks_for_tokens(num_total_tokens, self.block_size) - len(table)
        if new > 0:
            table.extend(self.pool.allocate(new, tenant))
        return True

    def _make_quota_room(self, tenant: Optional[str], needed: int, keep: Sequence[int]) -> bool:
        """Evicts the tenant's own cached blocks so `needed` more fit its quota; False (nothing
        evicted) if even that is not enough."""
        over = self._quota_excess(tenant, needed)
        if over == 0:
            return True
        if self.quota_shortfall(tenant, needed, keep) > 0:
            return False
        self.pool.evict_own(tenant, over, frozenset(keep))
        return True

    def _load_from_host(self, request_id: str, host_ids: list[int], table: list[int],
                        tenant: Optional[str] = None, inline_any_load: bool = False) -> None:
        # Held first: allocating may evict GPU blocks, and their write-backs must not take the host
        # blocks these loads read. The write-backs are queued first, so they read their GPU blocks
        # before these loads overwrite them.
        self.host_tier.begin_load(host_ids, self.block_size)
        device_ids = self.pool.allocate(len(host_ids), tenant, avoid=self._touched)
        self._queue_copies(HOST_STORE, DEVICE_STORE, host_ids, device_ids, LOAD,
                           self._new_ticket(request_id, LOAD, list(host_ids),
                                            self._runs_inline(len(host_ids), inline_any_load)))
        table.extend(device_ids)
        self._incoming_of[request_id] = list(host_ids)
        for host_id in host_ids:
            self._incoming[host_id] = request_id

    def free(self, request_id: str) -> None:
        self._end_incoming(request_id)
        self._waiting_for_incoming.discard(request_id)
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            self.host_tier.release(swapped[0])
        self._free_tiering(request_id)
        self._tenant_of.pop(request_id, None)
        table = self._block_tables.pop(request_id, None)
        state = self._cache_states.pop(request_id, None)
        if not table:
            return
        if self.prefix_cache is not None:
            now = self.prefix_cache.clock()
            self.prefix_cache.record_use(table, now)
            if state is not None and state.num_published > state.num_looked_up:
                self.prefix_cache.observe_release(
                    state.sequence.block_hashes[state.num_looked_up:state.num_published], state.num_looked_up, now)
        ticket = self._loading.pop(request_id, None)
        if ticket is not None:          # a copy still fills some of these blocks: freed when it lands
            self._orphaned[ticket] = table
            return
        self._touched.update(table)
        # Freed in reverse so the tail (least likely shared) is reused first.
        self.pool.free(reversed(table))

    def num_published_tokens(self, request_id: str) -> int:
        """Leading tokens of the request whose blocks are in the prefix cache (shared: never rewritten)."""
        state = self._cache_states.get(request_id)
        return state.num_published * self.block_size if state is not None else 0

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """A press shortened the request's KV to `num_tokens`: the blocks past them go back to the
        pool now. Returns how many. None of them may be published (the press's region is not:
        Request.publish_limit)."""
        table = self._block_tables.get(request_id)
        if table is None:
            return 0
        keep = blocks_for_tokens(num_tokens, self.block_size)
        state = self._cache_states.get(request_id)
        if state is not None and state.num_published > keep:
            raise RuntimeError(f"request {request_id}: a press may not free published blocks")
        tail = table[keep:]
        if not tail:
            return 0
        del table[keep:]
        self._touched.update(tail)
        self.pool.free(reversed(tail))
        return len(tail)

    # --- tiering (engine/kv_tiering.py) -------------------------------------------------------------
    def copy_to_host(self, request_id: str, positions: Sequence[int]) -> Optional[list[int]]:
        """Copies the request's blocks at these table positions to host blocks it holds until it
        is freed (in that order), or None, copying nothing, when the host tier cannot spare them.
        The copies run before the next forward, so a block demoted now is read before it is reused."""
        if self.host_tier is None:
            return None
        host_ids = self.host_tier.hold(len(positions))
        if host_ids is None:
            return None
        table = self._block_tables[request_id]
        self._queue_copies(DEVICE_STORE, HOST_STORE, [table[p] for p in positions], host_ids, SWAP_OUT)
        self._tier_host_ids.setdefault(request_id, set()).update(host_ids)
        return host_ids

    def demote(self, request_id: str, positions: Sequence[int]) -> None:
        """Drops the blocks at these table positions from the request's table (their KV is on the
        host: `copy_to_host`) and frees them; the other blocks keep their order."""
        table = self._block_tables[request_id]
        drop = set(positions)
        freed = [table[p] for p in sorted(drop)]
        table[:] = [block for p, block in enumerate(table) if p not in drop]
        self._touched.update(freed)
        self.pool.free(freed)

    def recall(self, request_id: str, host_id: int) -> Optional[int]:
        """Starts copying one of the request's held host blocks into a fresh GPU block; the recall's
        id (reported by `take_recalls` once it landed), or None when no GPU block is free."""
        if host_id not in self._tier_host_ids.get(request_id, ()):
            raise ValueError(f"request {request_id} holds no host block {host_id}")
        if self.pool.num_free_blocks < 1:
            return None
        block_id = self.pool.allocate(1, self._tenant_of.get(request_id))[0]
        recall_id, self._next_recall = self._next_recall, self._next_recall + 1
        last = self._pending_copies[-1] if self._pending_copies else None
        if self._recall_batch is not None and last is not None and last[3] == self._recall_batch:
            last[4].append(host_id)             # joins the copy queued last (nothing came between)
            last[5].append(block_id)
        else:
            self._recall_batch = self._new_ticket(request_id, RECALL, [])
            self._queue_copies(HOST_STORE, DEVICE_STORE, [host_id], [block_id], LOAD, self._recall_batch)
        self._recalling[recall_id] = (request_id, block_id, self._recall_batch)
        self._batch_recalls.setdefault(self._recall_batch, []).append(recall_id)
        return recall_id

    def take_recalls(self, request_id: str) -> list[tuple[int, Optional[int]]]:
        """(recall id, GPU block holding the recalled KV, or None if the copy failed) of the
        request's recalls that ended since the last call; the blocks are the caller's to place."""
        return self._recalled.pop(request_id, [])

    def insert_block(self, request_id: str, index: int, block_id: int) -> None:
        """Places a recalled full block at table position `index` (before the block that holds the
        next token)."""
        self._block_tables[request_id].insert(index, block_id)

    def replace_block(self, request_id: str, index: int, block_id: int) -> None:
        """Places a recalled block at table position `index` and frees the demoted one there."""
        table = self._block_tables[request_id]
        old, table[index] = table[index], block_id
        self._touched.add(old)
        self.pool.free([old])

    def _free_tiering(self, request_id: str) -> None:
        host_ids = self._tier_host_ids.pop(request_id, None)
        if host_ids:
            self.host_tier.release(host_ids)
        for ticket, block_id in self._recalled.pop(request_id, []):
            if block_id is not None:
                self._touched.add(block_id)
                self.pool.free([block_id])
        unissued = {copy[3]: copy for copy in self._pending_copies if copy[3] is not None}
        for recall_id, (owner, block_id, ticket) in list(self._recalling.items()):
            if owner != request_id:
                continue
            del self._recalling[recall_id]
            copy = unissued.get(ticket)
            if copy is not None:        # not handed to the worker yet: dropped, its block free now
                at = copy[5].index(block_id)
                del copy[4][at], copy[5][at]
                self._batch_recalls[ticket].remove(recall_id)
                if not copy[5]:
                    self._pending_copies.remove(copy)
                    del self._transfers[ticket], self._batch_recalls[ticket]
                    if self._recall_batch == ticket:
                        self._recall_batch = None
                self.pool.free([block_id])
            else:                       # being filled: freed when the copy lands
                self._orphaned.setdefault(ticket, []).append(block_id)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._block_tables)

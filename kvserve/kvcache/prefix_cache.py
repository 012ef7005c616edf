"""Prefix caching: full KV blocks addressed by the content of the whole prefix they end.

Block i of a sequence is keyed by hash_i = xxh3_128(hash_{i-1} || token ids of block i); the
chain starts from a root hash of the sequence's *namespace* (the tenant or its share group, plus
an optional per-request cache_salt). Two sequences therefore share block i only when they agree
on every token up to its end and on the namespace.

Collisions are never acted on blindly: a cached block keeps its own token ids, its parent's hash
and its namespace, and a hit requires all three to equal the request's. What is left unverified
is the tokens of earlier blocks, which the parent hash stands for: a false hit would need two
different prefixes with the same 128-bit xxh3 hash (birthday bound n^2 / 2^129: below 1e-26 for
a billion distinct cached blocks). The namespace is compared as a string, so one tenant can never
hit another tenant's block, whatever the hashes.

The cache owns the index (hash -> block), each cached block's access history, the evictor and
the pins. The block pool owns refcounts and asks the cache when a block's last owner leaves
(`on_release_many`: it becomes evictable) or a cached block is reused (`on_acquire`), and takes
victims from `evict()` when it has no empty block left.
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import numpy as np
import xxhash

from kvserve.kvcache.policies import (AccessStats, AdaptivePolicy, EvictionPolicy, Evictor,
                                      make_policy, note_continuation)
from kvserve.kvcache.kv_map import namespace_tenant
from kvserve.stats import KVMapPin, PrefixCacheStats, PrefixTree, PrefixTreeNode

_ROOT_DOMAIN = b"kvserve.prefix.v1\0"


def namespace_root(namespace: str) -> bytes:
    """The parent hash of a sequence's first block."""
    return xxhash.xxh3_128_digest(_ROOT_DOMAIN + namespace.encode("utf-8", "surrogatepass"))


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    # Fixed-width (int64) token encoding after a fixed-width (16-byte) parent: unambiguous.
    return xxhash.xxh3_128_digest(parent_hash + array("q", token_ids).tobytes())


def chain_hashes(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of `token_ids`, each chained to the one before (the first to
    `root`); equal to `hash_block` block by block. The tokens are encoded once, and each block
    hashes a slice of that buffer (a 32k-token prompt hashes 2,048 blocks)."""
    encoded = array("q", token_ids[:len(token_ids) - len(token_ids) % block_size]).tobytes()
    width = block_size * 8                      # int64 tokens
    hashes, parent, digest = [], root, xxhash.xxh3_128_digest
    for start in range(0, len(encoded), width):
        parent = digest(parent + encoded[start:start + width])
        hashes.append(parent)
    return hashes


def make_namespace(tenant: Optional[str], cache_salt: Optional[str], sharing: str = "tenant",
                   share_groups: Optional[dict[str, str]] = None) -> str:
    """The namespace a request's blocks live in. `sharing`: "tenant" (each tenant its own, the
    default), "global" (everyone shares). Tenants mapped to a share group share the group's."""
    if sharing == "global":
        scope = "global"
    elif tenant is not None and share_groups and tenant in share_groups:
        scope = "group:" + share_groups[tenant]
    else:
        scope = "tenant:" + (tenant or "")
    return scope if cache_salt is None else scope + "\0salt:" + cache_salt


def parse_share_groups(text: Optional[str]) -> dict[str, str]:
    """'a,b;c,d' -> {a: 'a,b', b: 'a,b', c: 'c,d', d: 'c,d'}: tenants in one group share prefixes."""
    groups: dict[str, str] = {}
    for group in (text or "").split(";"):
        members = sorted({m.strip() for m in group.split(",") if m.strip()})
        if not members:
            continue
        name = ",".join(members)
        for member in members:
            if member in groups:
                raise ValueError(f"tenant {member!r} is in two prefix share groups")
            groups[member] = name
    return groups


class HashedSequence(Protocol):
    """What the cache needs of a request (engine.request.Request satisfies it)."""
    request_id: str
    block_hashes: list[bytes]        # hashes of its full blocks so far, extended by the manager
    cache_root: bytes
    cache_namespace: str

    @property
    def num_tokens(self) -> int: ...

    def token_ids_between(self, start: int, end: int) -> list[int]: ...


@dataclass(slots=True, eq=False)
class CachedBlock:
    block_id: int
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    namespace: str
    stats: AccessStats


@dataclass
class Pin:
    pin_id: int
    namespace: str
    block_hashes: tuple[bytes, ...]
    expires_at: float


class PinLimitError(ValueError):
    """Pinning these blocks would pin more of the cache than allowed."""


class PrefixCache:
    def __init__(self, policy: EvictionPolicy, clock: Callable[[], float] = time.monotonic,
                 max_pinned_blocks: Optional[int] = None, history_blocks: int = 4096) -> None:
        self.policy = policy
        self.clock = clock
        self.max_pinned_blocks = max_pinned_blocks
        self._by_hash: dict[bytes, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._evictor = Evictor()
        # Access histories of recently evicted blocks, restored if the same content comes back:
        # LRU-K's "retained information" (without it a block evicted after its first use would
        # restart at one use every time, and a hot prefix could never prove itself hot).
        self._history: OrderedDict[bytes, AccessStats] = OrderedDict()
        self.history_blocks = history_blocks
        self._pins: dict[int, Pin] = {}
        self._pin_counts: dict[bytes, int] = {}
        self._pin_expiry: list[tuple[float, int]] = []
        self._pin_ids = itertools.count(1)
        self.num_lookups = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.evictions: dict[str, int] = {}
        self._track_fanout = policy.tracks_fanout
        # Told of the victims of one eviction (all the blocks one allocation needs) before they
        # are forgotten, while their KV is still intact (the host tier's write-back:
        # kvcache/manager.py). One call per allocation, because a long prefix evicts thousands.
        self.on_evict: Optional[Callable[[list[CachedBlock]], None]] = None
        # Told when the adaptive policy changes arm (old label, new label): the engine records it
        # as a config event (engine/runtime_config.py).
        self.on_policy_switch: Optional[Callable[[str, str], None]] = None
        if isinstance(policy, AdaptivePolicy):
            policy.on_switch = self._arm_switched

    # --- sizes --------------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)

    @property
    def num_evictable(self) -> int:
        return len(self._evictor)

    def holds(self, block_id: int) -> bool:
        return block_id in self._by_block

    def cached_block(self, block_id: int) -> Optional[CachedBlock]:
        return self._by_block.get(block_id)

    # --- index --------------------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[bytes], block_tokens: Callable[[int], Sequence[int]], root: bytes,
               namespace: str, max_blocks: int, start: int = 0) -> list[int]:
        """Block ids of the longest verified cached run from block index `start` (whose parent is
        `root`: the namespace's root at 0) up to index `max_blocks`. No side effects."""
        blocks: list[int] = []
        parent = root
        for index in range(start, min(max_blocks, len(block_hashes))):
            cached = self._by_hash.get(block_hashes[index])
            if (cached is None or cached.parent_hash != parent or cached.namespace != namespace
                    or cached.token_ids != tuple(block_tokens(index))):
                break
            blocks.append(cached.block_id)
            parent = block_hashes[index]
        return blocks

    def peek(self, root: bytes, namespace: str, token_ids: Sequence[int], block_size: int, max_blocks: int) -> int:
        """How many leading full blocks of `token_ids` are cached, by hash (tokens not verified).
        Reads only, touching no statistics: it may run on another thread while the engine thread
        changes the index (each dict read is atomic under the GIL), so the answer can be a step
        stale. For estimates (admission control), never for serving blocks."""
        parent, found = root, 0
        for start in range(0, min(max_blocks, len(token_ids) // block_size) * block_size, block_size):
            block_hash = hash_block(parent, token_ids[start:start + block_size])
            cached = self._by_hash.get(block_hash)
            if cached is None or cached.parent_hash != parent or cached.namespace != namespace:
                break
            found += 1
            parent = block_hash
        return found

    def insert(self, block_id: int, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int],
               namespace: str, depth: int) -> bool:
        """Makes a full, computed block addressable. False when the same content is already cached
        in another block (computed twice concurrently): this one stays private and is reused as
        an empty block when freed."""
        if block_hash in self._by_hash:
            return False
        if block_id in self._by_block:
            raise RuntimeError(f"block {block_id} is cached twice")
        stats = self._history.pop(block_hash, None) or AccessStats(depth)
        cached = CachedBlock(block_id, block_hash, parent_hash, tuple(token_ids), namespace, stats)
        self._by_hash[block_hash] = cached
        self._by_block[block_id] = cached
        if self._track_fanout:
            self._note_branch(parent_hash, block_hash)
        return True

    def _note_branch(self, parent_hash: bytes, block_hash: bytes) -> None:
        """If the new block continues its parent differently than before, the request's coming
        access to the parent and to every ancestor counts as a branch (fan-out). Only a flag is
        set, so no evictable block's priority changes here; and the ancestors are normally held
        by the inserting request, whose release records that access."""
        parent = self._by_hash.get(parent_hash)
        if parent is None or not note_continuation(parent.stats, block_hash):
            return
        while parent is not None:
            parent.stats.branch_pending = True
            parent = self._by_hash.get(parent.parent_hash)

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_lookups += 1
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def record_use(self, block_ids: Sequence[int], now: Optional[float] = None) -> None:
        """One request has finished using these blocks (one access each)."""
        now = self.clock() if now is None else now
        for block_id in block_ids:
            cached = self._by_block.get(block_id)
            if cached is not None:
                cached.stats.record(now)

    # --- called by the block pool ---------------------------------------------------------------------
    def on_release_many(self, block_ids: Sequence[int]) -> None:
        """These blocks' last owners left: they become evictable, in this order."""
        by_block, priority, pinned, add = self._by_block, self.policy.priority, self._pin_counts, self._evictor.add
        for block_id in block_ids:
            cached = by_block[block_id]
            stats = cached.stats
            add(block_id, priority(stats), stats.depth, cached.block_hash in pinned)

    def on_acquire(self, block_id: int) -> None:
        """A request takes an evictable cached block back (a hit)."""
        self._evictor.remove(block_id)

    def evict(self) -> int:
        """Forgets the policy's victim and returns its block id, now empty."""
        return self.evict_many(1)[0]

    def evict_many(self, count: int, among: Optional[Callable[[int], bool]] = None) -> list[int]:
        """Forgets the policy's next `count` victims (only blocks `among` accepts, when given: a
        tenant at its KV quota evicts its own), in order, and returns their block ids, now empty."""
        self._expire_pins()
        by_block, by_hash, policy = self._by_block, self._by_hash, self.policy
        label = policy.label
        if among is None:
            pop = self._evictor.pop
            chosen = [pop() for _ in range(count)]
        else:
            chosen = self._evictor.pop_matching(among, count)
            count = len(chosen)
        victims: list[CachedBlock] = []
        for block_id, priority in chosen:
            cached = by_block.pop(block_id)
            del by_hash[cached.block_hash]
            victims.append(cached)
            policy.on_evict(priority)
        if self.on_evict is not None:
            self.on_evict(victims)
        if self.history_blocks > 0:
            history = self._history
            for cached in victims:
                history[cached.block_hash] = cached.stats
            while len(history) > self.history_blocks:
                history.popitem(last=False)
        self.evictions[label] = self.evictions.get(label, 0) + count
        return [cached.block_id for cached in victims]

    # --- the adaptive policy's view of the traffic --------------------------------------------------
    def observe_lookup(self, block_hashes: list[bytes], now: Optional[float] = None) -> None:
        self.policy.observe_lookup(block_hashes, self.clock() if now is None else now)

    def observe_release(self, block_hashes: list[bytes], first_depth: int, now: Optional[float] = None) -> None:
        if block_hashes:
            self.policy.observe_release(block_hashes, first_depth, self.clock() if now is None else now)

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Ranks by `policy` from now on (a run-time change of --eviction-policy): the evictable
        blocks are re-keyed under it at once, keeping their access histories. Fan-out is tracked
        from now on if it needs it, so a fanout ranking starts without the branches seen before."""
        if isinstance(self.policy, AdaptivePolicy):
            self.policy.on_switch = None
        self.policy = policy
        self._track_fanout = policy.tracks_fanout
        if isinstance(policy, AdaptivePolicy):
            policy.on_switch = self._arm_switched
        self._rekey()

    def _arm_switched(self, old: str, new: str) -> None:
        self._rekey()
        if self.on_policy_switch is not None:
            self.on_policy_switch(old, new)

    def _rekey(self) -> None:
        entries = []
        for block_id in self._evictor.keys():
            cached = self._by_block[block_id]
            entries.append((block_id, self.policy.priority(cached.stats), cached.stats.depth,
                            self._evictor.is_pinned(block_id)))
        self._evictor.rebuild(entries)

    # --- pins ----------------------------------------------------------------------------------------
    def pin(self, block_hashes: Sequence[bytes], namespace: str, ttl_s: float) -> Pin:
        """Keeps these blocks (cached now or later) in the last eviction tier for ttl_s seconds."""
        if not ttl_s > 0:
            raise ValueError(f"a pin needs a positive retention time, got {ttl_s}")
        self._expire_pins()
        unique = tuple(dict.fromkeys(block_hashes))
        new = sum(1 for h in unique if h not in self._pin_counts)
        if self.max_pinned_blocks is not None and len(self._pin_counts) + new > self.max_pinned_blocks:
            raise PinLimitError(f"pinning {new} more blocks would exceed the limit of {self.max_pinned_blocks} "
                                f"pinned blocks ({len(self._pin_counts)} pinned now)")
        pin = Pin(next(self._pin_ids), namespace, unique, self.clock() + ttl_s)
        self._pins[pin.pin_id] = pin
        heapq.heappush(self._pin_expiry, (pin.expires_at, pin.pin_id))
        for block_hash in unique:
            count = self._pin_counts.get(block_hash, 0)
            self._pin_counts[block_hash] = count + 1
            if count == 0:
                self._set_tier(block_hash, pinned=True)
        return pin

    def unpin(self, pin_id: int, namespace: Optional[str] = None) -> bool:
        """Removes a pin; with `namespace`, only a pin of that namespace (a tenant's own)."""
        pin = self._pins.get(pin_id)
        if pin is None or (namespace is not None and pin.namespace != namespace):
            return False
        self._drop_pin(pin)
        return True

    def pins(self, namespace: Optional[str] = None) -> list[Pin]:
        self._expire_pins()
        return [p for p in self._pins.values() if namespace is None or p.namespace == namespace]

    def is_pinned(self, block_hash: bytes) -> bool:
        return block_hash in self._pin_counts

    def num_cached_of(self, block_hashes: Sequence[bytes]) -> int:
        return sum(1 for h in block_hashes if h in self._by_hash)

    def _drop_pin(self, pin: Pin) -> None:
        del self._pins[pin.pin_id]
        for block_hash in pin.block_hashes:
            count = self._pin_counts[block_hash] - 1
            if count:
                self._pin_counts[block_hash] = count
            else:
                del self._pin_counts[block_hash]
                self._set_tier(block_hash, pinned=False)

    def _set_tier(self, block_hash: bytes, pinned: bool) -> None:
        cached = self._by_hash.get(block_hash)
        if cached is not None and cached.block_id in self._evictor:
            self._evictor.add(cached.block_id, self.policy.priority(cached.stats), cached.stats.depth, pinned)

    def _expire_pins(self) -> None:
        now = self.clock()
        while self._pin_expiry and self._pin_expiry[0][0] <= now:
            _, pin_id = heapq.heappop(self._pin_expiry)
            pin = self._pins.get(pin_id)
            if pin is not None:
                self._drop_pin(pin)

    # --- reporting ----------------------------------------------------------------------------------
    def make_stats(self, policy_name: str) -> PrefixCacheStats:
        self._expire_pins()
        pinned = sum(1 for h in self._pin_counts if h in self._by_hash)
        adaptive = self.policy.snapshot() if isinstance(self.policy, AdaptivePolicy) else None
        return PrefixCacheStats(policy_name, self.policy.label, self.num_lookups, self.num_query_tokens,
                                self.num_hit_tokens, self.num_cached_blocks, self.num_evictable, pinned,
                                len(self._pins), dict(self.evictions), adaptive)

    # --- the KV map (kvcache/kv_map.py) -------------------------------------------------------------
    def block_uses(self, now: float, half_life_s: float) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(cached block ids, their recent uses, the pinned ones among them): a block's recent uses
        are those its history keeps (the last MAX_HISTORY) decayed by the time since the newest,
        halving every `half_life_s`, one power per block where decaying each use apart would cost
        up to eight."""
        self._expire_pins()
        by_block, by_hash = self._by_block, self._by_hash
        values = list(by_block.values())
        ids = np.fromiter(by_block.keys(), dtype=np.int64, count=len(values))
        histories = [cached.stats.times for cached in values]
        counts = np.fromiter(map(len, histories), dtype=np.float64, count=len(values))
        newest = np.array([times[-1] if times else now for times in histories], dtype=np.float64)
        uses = counts * np.exp2((newest - now) / max(half_life_s, 1e-9))
        pinned = [by_hash[block_hash].block_id for block_hash in self._pin_counts if block_hash in by_hash]
        return ids, uses, pinned

    def uses_of(self, block_hash: bytes, now: float, half_life_s: float) -> float:
        """`block_uses`' figure for a block by hash, cached or evicted (the access histories kept
        of evicted blocks): what a host-tier copy of it is worth."""
        cached = self._by_hash.get(block_hash)
        stats = cached.stats if cached is not None else self._history.get(block_hash)
        if stats is None or not stats.times:
            return 0.0
        return len(stats.times) * 0.5 ** ((now - stats.times[-1]) / max(half_life_s, 1e-9))

    def make_pins(self) -> tuple[KVMapPin, ...]:
        now = self.clock()
        return tuple(KVMapPin(pin.pin_id, namespace_tenant(pin.namespace), len(pin.block_hashes),
                              self.num_cached_of(pin.block_hashes), pin.expires_at - now)
                     for pin in self.pins())

    def make_prefix_trees(self, max_trees: int, max_nodes: int) -> tuple[tuple[PrefixTree, ...], int]:
        """The `max_trees` largest trees of cached blocks (by blocks), each with at most `max_nodes`
        segments (runs without a branch; the largest subtrees first), and how many trees there are.
        A root is a block whose parent is not cached: a first block, or one whose parent was
        evicted before it. One pass over the cached blocks to size every tree."""
        by_hash = self._by_hash
        children: dict[bytes, list[CachedBlock]] = {}
        roots: list[CachedBlock] = []
        for cached in by_hash.values():
            parent = cached.parent_hash
            if parent in by_hash:
                siblings = children.get(parent)
                if siblings is None:
                    children[parent] = [cached]
                else:
                    siblings.append(cached)
            else:
                roots.append(cached)
        trees = []
        for root in roots:
            # Segments in depth-first order, each after its parent: (parent index, its blocks).
            segments: list[tuple[int, list[CachedBlock]]] = []
            stack: list[tuple[CachedBlock, int]] = [(root, -1)]
            size = 0
            while stack:
                block, parent = stack.pop()
                run = [block]
                kids = children.get(block.block_hash)
                while kids is not None and len(kids) == 1:
                    block = kids[0]
                    run.append(block)
                    kids = children.get(block.block_hash)
                segments.append((parent, run))
                size += len(run)
                if kids:
                    index = len(segments) - 1
                    stack.extend((kid, index) for kid in kids)
            trees.append((size, root, segments))
        trees.sort(key=lambda tree: -tree[0])
        return tuple(self._prefix_tree(root, segments, size, max_nodes)
                     for size, root, segments in trees[:max_trees]), len(trees)

    def _prefix_tree(self, root: CachedBlock, segments: list[tuple[int, list[CachedBlock]]], size: int,
                     max_nodes: int) -> PrefixTree:
        pinned, evictable = self._pin_counts, self._evictor
        subtree = [len(run) for _, run in segments]
        for index in range(len(segments) - 1, 0, -1):        # children come after their parents
            subtree[segments[index][0]] += subtree[index]
        kids: dict[int, list[int]] = {}
        for index, (parent, _) in enumerate(segments):
            kids.setdefault(parent, []).append(index)
        # The largest subtrees first, a parent always before its children.
        chosen: dict[int, int] = {}
        frontier = [(-subtree[0], 0)]
        while frontier and len(chosen) < max_nodes:
            _, index = heapq.heappop(frontier)
            chosen[index] = len(chosen)
            for kid in kids.get(index, ()):
                heapq.heappush(frontier, (-subtree[kid], kid))
        num_pinned = num_held = max_depth = 0
        nodes: dict[int, PrefixTreeNode] = {}
        for index, (parent, run) in enumerate(segments):
            seg_pinned = sum(1 for block in run if block.block_hash in pinned) if pinned else 0
            seg_held = sum(1 for block in run if block.block_id not in evictable)
            num_pinned += seg_pinned
            num_held += seg_held
            max_depth = max(max_depth, run[-1].stats.depth)
            if index in chosen:
                newest = [block.stats.times[-1] for block in run if block.stats.times]
                nodes[index] = PrefixTreeNode(chosen.get(parent, -1), run[0].stats.depth, len(run),
                                              run[0].stats.count, seg_pinned, seg_held, max(newest) if newest else None)
        # A segment ends where its last block is continued by several blocks: one branch each.
        num_branches = sum(1 for parent, children in kids.items() if parent >= 0 and len(children) > 1)
        return PrefixTree(namespace_tenant(root.namespace), size, max_depth, num_branches, root.stats.count,
                          num_pinned, num_held, tuple(nodes[index] for index in chosen), len(segments))


def build_prefix_cache(cache_config, num_blocks: int,
                       clock: Callable[[], float] = time.monotonic) -> Optional[PrefixCache]:
    """The engine's prefix cache from CacheConfig fields (None when prefix caching is off)."""
    parse_share_groups(cache_config.prefix_share_groups)   # a bad spec is an error at start-up
    if not cache_config.enable_prefix_caching:
        return None
    return PrefixCache(policy_from_config(cache_config, num_blocks), clock,
                       max_pinned_blocks=int(num_blocks * cache_config.max_pinned_fraction),
                       history_blocks=2 * num_blocks)


def policy_from_config(cache_config, num_blocks: int) -> EvictionPolicy:
    """The eviction policy CacheConfig's eviction_policy, lru_k and heat_half_life_s name (at start,
    and when the admin config API changes them)."""
    return make_policy(cache_config.eviction_policy, lru_k=cache_config.lru_k,
                       half_life_s=cache_config.heat_half_life_s, num_blocks=num_blocks)

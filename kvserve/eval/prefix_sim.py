"""Prefix-cache replay of a trace (kvserve.eval.prefix_traces) through the engine's own
`KVCacheManager` + `PrefixCache` on a simulated clock, per eviction policy, and the offline
yardsticks it is judged against (benchmarks/kv/prefix_bench.py reports them; tests check them).

The replay is the code the scheduler calls (`find_cached_prefix`, `allocate_slots`,
`cache_full_blocks`, `free`): a request holds all its blocks while it runs; only full computed
blocks are cached; the last prompt token is always recomputed. Belady's MIN replays the same trace
with the same block accounting but evicts the cached block whose next use is farthest in the future
(ties deeper-first). `simulate_dead_first_lru` is lru that also knows which blocks no later request
looks up and evicts those first: what knowing *that* a conversation has ended is worth, without
knowing *when* the others come back (below MIN, but not above every online policy: it has no notion
of frequency). `simulate_shared_last_lru` is lru that knows from the whole trace which blocks are
shared prefixes (at or above a branch of the chain tree: system prompts) and evicts them last: what
learning the shared prefixes perfectly, with recency for the rest, is worth.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from kvserve.eval.prefix_traces import BLOCK_SIZE, TraceRequest
from kvserve.kvcache.manager import KVCacheManager, blocks_for_tokens
from kvserve.kvcache.policies import LRUPolicy, make_policy
from kvserve.kvcache.prefix_cache import PrefixCache, chain_hashes, namespace_root

POLICIES = ("lru", "lru-k", "lfu-age", "fanout", "adaptive")
FIXED_POLICIES = tuple(p for p in POLICIES if p != "adaptive")


@dataclass
class SimSequence:
    """What the KV manager needs of a request (engine.request.Request's prefix-cache surface)."""
    request_id: str
    tokens: list[int]
    cache_namespace: str = ""
    block_hashes: list[bytes] = field(default_factory=list)
    cache_root: bytes = b""

    def __post_init__(self) -> None:
        self.cache_root = namespace_root(self.cache_namespace)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _replay(trace: list[TraceRequest], capacity_blocks: int, cache: PrefixCache, clock: SimClock,
            on_request: Optional[Callable[[int], None]] = None) -> float:
    """Token hit rate of the trace replayed request by request through the KV manager and `cache`."""
    manager = KVCacheManager(capacity_blocks, BLOCK_SIZE, cache)
    query = hit = 0
    for index, request in enumerate(trace):
        clock.now = request.time
        if on_request is not None:
            on_request(index)
        rid = str(index)
        seq = SimSequence(rid, list(request.prompt), request.namespace)
        prefix = manager.find_cached_prefix(seq)
        ok = manager.allocate_slots(rid, len(seq.tokens), prefix, seq)
        assert ok, "the cache is smaller than one request"
        query += len(request.prompt)
        hit += prefix.num_tokens
        manager.cache_full_blocks(rid, len(seq.tokens))
        # Decode: every generated token but the last is fed back, so its KV is computed.
        seq.tokens += request.output
        assert manager.allocate_slots(rid, len(seq.tokens))
        manager.cache_full_blocks(rid, len(seq.tokens) - 1)
        manager.free(rid)
    assert manager.num_free_blocks == capacity_blocks
    return hit / query


def simulate_policy(trace: list[TraceRequest], capacity_blocks: int, policy_name: str,
                    lru_k: int = 2, half_life_s: float = 120.0) -> dict:
    clock = SimClock()
    policy = make_policy(policy_name, lru_k=lru_k, half_life_s=half_life_s, num_blocks=capacity_blocks)
    # Retained histories as the engine keeps them (build_prefix_cache): 2x the pool's blocks.
    cache = PrefixCache(policy, clock, history_blocks=2 * capacity_blocks)
    result = {"hit_rate": _replay(trace, capacity_blocks, cache, clock), "evictions": dict(cache.evictions)}
    if policy_name == "adaptive":
        snap = policy.snapshot()
        result["adaptive"] = {"final_arm": snap.active, "num_switches": snap.num_switches,
                              "shadow_hit_rates": {k: round(v, 4) for k, v in snap.shadow_hit_rates.items()},
                              "recent_decisions": list(snap.recent_decisions)}
    return result


NextUse = Callable[[bytes, int], float]


def _future_lookups(trace: list[TraceRequest]) -> tuple[list[list[bytes]], list[list[bytes]], NextUse]:
    """Per request, the hashes of its full computed blocks and of the blocks its lookup may hit,
    and next_use(hash, after): the index of the next request after `after` that looks it up."""
    bs = BLOCK_SIZE
    lookups, chains = [], []
    for request in trace:
        full = chain_hashes(namespace_root(request.namespace), request.prompt + request.output[:-1], bs)
        chains.append(full)
        lookups.append(full[:(len(request.prompt) - 1) // bs])
    uses: dict[bytes, list[int]] = {}          # hash -> indices of the requests that look it up
    for index, chain in enumerate(lookups):
        for h in chain:
            uses.setdefault(h, []).append(index)

    def next_use(h: bytes, after: int) -> float:
        seq = uses.get(h, ())
        i = bisect.bisect_right(seq, after)
        return seq[i] if i < len(seq) else math.inf

    return chains, lookups, next_use


class _DeadFirstCache(PrefixCache):
    """LRU that also knows which released blocks no later request will look up, and evicts those
    first. Not a policy (it reads the future): it measures what knowing *that* a conversation
    has ended is worth, leaving to Belady only the foresight of *when* the others come back."""

    def __init__(self, clock: SimClock, next_use: NextUse, capacity_blocks: int) -> None:
        super().__init__(LRUPolicy(), clock, history_blocks=2 * capacity_blocks)
        self._next_use = next_use
        self.request_index = 0

    def on_release_many(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            cached = self._by_block[block_id]
            dead = self._next_use(cached.block_hash, self.request_index) == math.inf
            self._evictor.add(block_id, -math.inf if dead else cached.stats.times[-1], cached.stats.depth)


def simulate_dead_first_lru(trace: list[TraceRequest], capacity_blocks: int) -> float:
    _, _, next_use = _future_lookups(trace)
    clock = SimClock()
    cache = _DeadFirstCache(clock, next_use, capacity_blocks)
    return _replay(trace, capacity_blocks, cache, clock,
                   on_request=lambda index: setattr(cache, "request_index", index))


def shared_prefix_blocks(trace: list[TraceRequest]) -> set[bytes]:
    """The blocks of the trace's shared prefixes: every block at or above a branch of the chain
    tree (a block with two or more distinct children over the whole trace), e.g. system prompts."""
    children: dict[bytes, set[bytes]] = {}
    parent: dict[bytes, bytes] = {}
    for chain in _future_lookups(trace)[0]:
        for above, below in zip(chain, chain[1:]):
            children.setdefault(above, set()).add(below)
            parent[below] = above
    shared: set[bytes] = set()
    for branch in (h for h, kids in children.items() if len(kids) > 1):
        h: Optional[bytes] = branch
        while h is not None and h not in shared:
            shared.add(h)
            h = parent.get(h)
    return shared


class _SharedLastCache(PrefixCache):
    """LRU that knows, from the whole trace, which blocks are shared prefixes (see
    shared_prefix_blocks) and evicts them only when nothing else is left. On a trace whose
    conversations come back after memoryless think times, recency orders the conversations as
    well as anything observable can, so this is what an online policy could reach by learning
    the shared prefixes perfectly: a yardstick, not a bound (it has no frequency)."""

    def __init__(self, clock: SimClock, shared: set[bytes], capacity_blocks: int) -> None:
        super().__init__(LRUPolicy(), clock, history_blocks=2 * capacity_blocks)
        self._shared = shared

    def on_release_many(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            cached = self._by_block[block_id]
            # The evictor's pinned tier goes only when nothing else is left.
            self._evictor.add(block_id, cached.stats.times[-1], cached.stats.depth, cached.block_hash in self._shared)


def simulate_shared_last_lru(trace: list[TraceRequest], capacity_blocks: int,
                             shared: Optional[set[bytes]] = None) -> float:
    """`shared`: shared_prefix_blocks(trace), when the caller replays several cache sizes."""
    clock = SimClock()
    shared = shared_prefix_blocks(trace) if shared is None else shared
    return _replay(trace, capacity_blocks, _SharedLastCache(clock, shared, capacity_blocks), clock)


def simulate_belady(trace: list[TraceRequest], capacity_blocks: int) -> float:
    """Belady's MIN under the same block accounting as the replay above: when a request needs
    blocks, the cached blocks it does not hold whose next use is farthest away go first."""
    bs = BLOCK_SIZE
    chains, lookups, next_use = _future_lookups(trace)
    cached: dict[bytes, float] = {}            # resident hash -> next use it was queued with
    heap: list[tuple[float, int, int, bytes]] = []   # (-next use, -depth, tie, hash); stale entries skipped
    tie = itertools.count()
    query = hit = 0
    for index, request in enumerate(trace):
        lookup = lookups[index]
        hits = 0
        for h in lookup:
            if h not in cached:
                break
            hits += 1
        query += len(request.prompt)
        hit += hits * bs
        held = set(lookup[:hits])
        needed = blocks_for_tokens(len(request.prompt) + len(request.output), bs) - hits
        aside = []
        while len(cached) + needed > capacity_blocks:
            entry = heapq.heappop(heap)
            h = entry[3]
            if cached.get(h) != -entry[0]:
                continue                        # stale
            if h in held:
                aside.append(entry)
                continue
            del cached[h]
        for entry in aside:
            heapq.heappush(heap, entry)
        # The request's full computed blocks stay cached, each queued with its next use.
        for depth, h in enumerate(chains[index]):
            nu = next_use(h, index)
            cached[h] = nu
            heapq.heappush(heap, (-nu, -depth, next(tie), h))
        assert len(cached) <= capacity_blocks
    return hit / query

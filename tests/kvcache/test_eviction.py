"""Eviction order of each policy on hand-built access sequences; pins; the adaptive policy."""

from __future__ import annotations

import math

import pytest

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.policies import (AccessStats, Evictor, FanoutPolicy, LFUAgePolicy, LRUKPolicy, LRUPolicy,
                                      make_policy)
from kvserve.kvcache.policies.adaptive import AdaptivePolicy, ShadowCache, default_arms
from kvserve.kvcache.prefix_cache import PinLimitError, PrefixCache, chain_hashes, hash_block, namespace_root


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A pool whose blocks are named; `use(name, t)` = one request using that block at time t."""

    def __init__(self, policy, num_blocks: int = 16, max_pinned_blocks=None) -> None:
        self.clock = Clock()
        self.cache = PrefixCache(policy, self.clock, max_pinned_blocks)
        self.pool = BlockPool(num_blocks, self.cache)
        self.blocks: dict[str, int] = {}
        self.names: dict[int, str] = {}

    @staticmethod
    def hash_of(name: str) -> bytes:
        return hash_block(namespace_root(""), [ord(c) for c in name])

    def use(self, name: str, t: float, depth: int = 0) -> None:
        self.clock.now = t
        block = self.blocks.get(name)
        if block is None:
            [block] = self.pool.allocate(1)
            assert self.cache.insert(block, self.hash_of(name), namespace_root(""), [ord(c) for c in name], "", depth)
            self.blocks[name], self.names[block] = block, name
        else:
            self.pool.acquire_cached(block)
        self.cache.record_use([block], t)
        self.pool.free([block])

    def use_chain(self, names: list[str], t: float) -> None:
        """One request using a prefix chain of blocks: the ones not cached yet are computed and
        inserted under their parent, as KVCacheManager.cache_full_blocks does."""
        self.clock.now = t
        parent, table = namespace_root(""), []
        for depth, name in enumerate(names):
            block = self.blocks.get(name)
            if block is None:
                [block] = self.pool.allocate(1)
                assert self.cache.insert(block, self.hash_of(name), parent, [ord(c) for c in name], "", depth)
                self.blocks[name], self.names[block] = block, name
            else:
                self.pool.acquire_cached(block)
            table.append(block)
            parent = self.hash_of(name)
        self.cache.record_use(table, t)
        self.pool.free(reversed(table))

    def eviction_order(self) -> list[str]:
        order = []
        while self.cache.num_evictable:
            block = self.cache.evict()
            order.append(self.names.pop(block))
            self.pool._empty.append(block)   # what allocate() would do with it
        return order


def test_lru_evicts_least_recently_used_and_deeper_first_on_ties():
    h = Harness(LRUPolicy())
    for name, t in [("a", 1), ("b", 2), ("c", 3), ("a", 4)]:
        h.use(name, t)
    assert h.eviction_order() == ["b", "c", "a"]
    h = Harness(LRUPolicy())
    # One request's chain, released at one instant: the tail goes before its parents.
    for depth, name in enumerate(["root", "mid", "tail"]):
        h.use(name, 1.0, depth)
    assert h.eviction_order() == ["tail", "mid", "root"]


def test_lru_k_ranks_twice_used_above_once_used_until_heat_decays():
    policy = LRUKPolicy(k=2, half_life_s=10.0)
    h = Harness(policy)
    h.use("hot", 0.0)
    h.use("hot", 1.0)
    h.use("once", 5.0)          # more recent, but used once: scan resistance
    h.use("later-once", 30.0)   # 3 half-lives after "hot": hot's heat 2^-2.9 + 2^-3 < 1
    assert h.eviction_order() == ["once", "hot", "later-once"]
    # The priority is log2 of the undecayed heat of the last K accesses.
    stats = AccessStats(0)
    for t in (0.0, 1.0):
        stats.record(t)
    assert policy.priority(stats) == pytest.approx(math.log2(2 ** 0.0 + 2 ** 0.1))


def test_lru_k_counts_only_the_last_k_accesses():
    h = Harness(LRUKPolicy(k=2, half_life_s=10.0))
    for t in range(5):
        h.use("old-favourite", float(t))      # five uses, the last two at t=3, 4
    h.use("new", 4.5)
    h.use("new", 5.0)
    assert h.eviction_order() == ["old-favourite", "new"]
    h = Harness(LFUAgePolicy())
    for t in range(5):
        h.use("old-favourite", float(t))
    h.use("new", 4.5)
    h.use("new", 5.0)
    assert h.eviction_order() == ["new", "old-favourite"]   # frequency wins under LFU


def test_lfu_age_orders_by_uses_and_ages_out_old_popularity():
    policy = LFUAgePolicy()
    h = Harness(policy)
    for name, uses in [("a", 3), ("b", 1), ("c", 2)]:
        for i in range(uses):
            h.use(name, float(i))
    assert h.eviction_order() == ["b", "c", "a"]
    assert policy.age == 3.0

    policy = LFUAgePolicy()
    h = Harness(policy)
    for i in range(3):
        h.use("a", float(i))                       # priority 0 + 3
    h.use("f1", 3.0)                                # 1
    h.use("f2", 3.0)
    h.use("f2", 4.0)                                # 2
    order = [h.names[h.cache.evict()] for _ in range(2)]
    assert order == ["f1", "f2"] and policy.age == 2.0
    h.use("d", 5.0)
    h.use("d", 6.0)                                 # age 2 + 2 uses = 4 > 3: a, once popular, goes first
    assert h.eviction_order() == ["a", "d"]


# A two-block system prompt (s0, s1) that three requests branch off (a, b, d); a conversation c
# that runs three turns (c, then c + c2, then c + c2 + c3) and branches nowhere; a one-off e.
_FANOUT_TRACE = [(["s0", "s1", "a"], 0.0), (["s0", "s1", "b"], 1.0), (["c"], 2.0), (["c", "c2"], 3.0),
                 (["c", "c2", "c3"], 4.0), (["s0", "s1", "d"], 5.0), (["e"], 6.0)]


def test_fanout_counts_branches_not_turns():
    policy = FanoutPolicy(k=2, half_life_s=10.0)
    h = Harness(policy)
    for chain, t in _FANOUT_TRACE:
        h.use_chain(chain, t)
    s0 = h.cache.cached_block(h.blocks["s0"]).stats
    # b opened a branch under s1 (a continued it before): s1 and its ancestor s0 count that access.
    # d's access (the newest) opened one too; it counts once it is an earlier access.
    assert s0.branches == (1.0,) and s0.newest_branched and s0.last_child == h.hash_of("s1")
    c = h.cache.cached_block(h.blocks["c"]).stats
    assert c.count == 3 and c.branches == ()       # continuing a conversation is no branch
    # Heats in units of h: a 0, b 0.1, c/c2/c3 0.4 (recency only, deeper first), d 0.5, e 0.6,
    # s1/s0 0.5 + log2(1 + 2^-0.4) = 1.31 (the t=1 branch counts).
    assert policy.priority(s0) == pytest.approx(0.5 + math.log2(1 + 2 ** -0.4))
    assert h.eviction_order() == ["a", "b", "c3", "c2", "c", "d", "e", "s1", "s0"]

    # lru-k counts the conversation's turns as frequency: c and c2 (used at t=3 and 4, heat
    # 0.4 + log2(1 + 2^-0.1) = 1.35) outlive the shared prompt and the newer one-offs.
    h = Harness(LRUKPolicy(k=2, half_life_s=10.0))
    for chain, t in _FANOUT_TRACE:
        h.use_chain(chain, t)
    assert h.eviction_order() == ["a", "b", "c3", "d", "e", "s1", "s0", "c2", "c"]


def test_fanout_k_counts_the_latest_branches_and_recomputing_a_child_is_no_branch():
    policy = FanoutPolicy(k=3, half_life_s=10.0)
    h = Harness(policy)
    for t, leaf in enumerate(["a", "b", "c", "d"]):
        h.use_chain(["s", leaf], float(t))         # a new branch under s at t = 1, 2, 3
    s = h.cache.cached_block(h.blocks["s"]).stats
    assert s.branches == (1.0, 2.0) and s.newest_branched
    assert policy.priority(s) == pytest.approx(0.3 + math.log2(1 + 2 ** -0.1 + 2 ** -0.2))   # K-1 = 2 of them
    assert FanoutPolicy(k=1, half_life_s=10.0).priority(s) == pytest.approx(0.3)           # recency only
    # The leaves go, then d is computed again under s: the continuation s saw last, no branch.
    evicted = [h.cache.evict() for _ in range(4)]
    assert [h.names[block] for block in evicted] == ["a", "b", "c", "d"]
    for block in evicted:
        h.pool._empty.append(block)
        del h.blocks[h.names.pop(block)]
    h.use_chain(["s", "d"], 4.0)
    assert s.branches == (1.0, 2.0, 3.0) and not s.newest_branched
    h.use_chain(["s", "e"], 5.0)                     # a new continuation is one
    assert s.newest_branched


def test_shadow_cache_tracks_fanout_like_the_real_cache():
    policy = FanoutPolicy(k=2, half_life_s=10.0)
    h = Harness(policy)
    shadow = ShadowCache(policy.clone(), capacity_blocks=64)
    for chain, t in _FANOUT_TRACE:
        h.use_chain(chain, t)
        shadow.use([h.hash_of(name) for name in chain], list(range(len(chain))), t)
    for name, block in h.blocks.items():
        real, ghost = h.cache.cached_block(block).stats, shadow._stats[h.hash_of(name)]
        assert (ghost.times, ghost.branches, ghost.newest_branched) == (real.times, real.branches, real.newest_branched)
    # Policies that do not rank by fan-out leave it alone (no bookkeeping for them).
    plain = ShadowCache(LRUPolicy(), capacity_blocks=64)
    for chain, t in _FANOUT_TRACE:
        plain.use([h.hash_of(name) for name in chain], list(range(len(chain))), t)
    assert all(stats.branches == () and stats.last_child is None for stats in plain._stats.values())


def test_pinned_blocks_are_evicted_last_until_the_pin_expires():
    h = Harness(LRUPolicy())
    h.use("system", 1.0)
    h.use("other", 2.0)
    pin = h.cache.pin([h.hash_of("system")], "", ttl_s=10.0)
    h.use("newer", 3.0)
    h.clock.now = 5.0
    assert h.eviction_order() == ["other", "newer", "system"]

    h = Harness(LRUPolicy())
    h.cache.pin([h.hash_of("system")], "", ttl_s=10.0)   # pinned before it is ever computed
    h.use("system", 1.0)
    h.use("other", 2.0)
    h.clock.now = 11.0                                   # expired: plain LRU again
    assert h.eviction_order() == ["system", "other"]
    assert pin.pin_id == 1 and h.cache.pins() == []

    h = Harness(LRUPolicy(), max_pinned_blocks=1)
    h.use("a", 1.0)
    h.use("b", 2.0)
    first = h.cache.pin([h.hash_of("a")], "t1", 100.0)
    with pytest.raises(PinLimitError):
        h.cache.pin([h.hash_of("b")], "t1", 100.0)
    assert not h.cache.unpin(first.pin_id, namespace="t2")   # not that tenant's pin
    assert h.cache.unpin(first.pin_id, namespace="t1")
    assert h.eviction_order() == ["a", "b"]


def test_evictor_skips_stale_entries_and_rebuilds():
    evictor = Evictor()
    for key, priority in [("x", 3.0), ("y", 1.0), ("z", 2.0)]:
        evictor.add(key, priority, 0)
    evictor.add("y", 5.0, 0)         # re-ranked
    assert evictor.remove("z") and not evictor.remove("z")
    assert evictor.pop() == ("x", 3.0)
    evictor.rebuild([("p", 2.0, 0, True), ("q", 9.0, 0, False)])
    assert len(evictor) == 2 and evictor.num_pinned == 1
    assert [evictor.pop()[0] for _ in range(2)] == ["q", "p"]
    with pytest.raises(IndexError):
        evictor.pop()


def test_make_policy_names():
    assert make_policy("lru").label == "lru"
    assert make_policy("lru-k", lru_k=3, half_life_s=60).label == "lru-k(k=3,h=60s)"
    assert make_policy("lfu-age").label == "lfu-age"
    assert make_policy("fanout", lru_k=3, half_life_s=60).label == "fanout(k=3,h=60s)"
    adaptive = make_policy("adaptive", num_blocks=64)
    assert isinstance(adaptive, AdaptivePolicy) and adaptive.tracks_fanout
    assert "fanout(k=4,h=120s)" in [arm.label for arm in adaptive.arms]
    assert [p.tracks_fanout for p in default_arms()] == [False] * 6 + [True]
    with pytest.raises(ValueError):
        make_policy("fifo")
    with pytest.raises(ValueError):
        LRUKPolicy(k=0)
    with pytest.raises(ValueError):
        FanoutPolicy(k=9)


# --------------------------------------------------------------------------------------------------
# adaptive
# --------------------------------------------------------------------------------------------------

class _Seq:
    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id, self.tokens = request_id, tokens
        self.block_hashes: list[bytes] = []
        self.cache_namespace = ""
        self.cache_root = namespace_root("")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def replay(policy, prompts: list[list[int]], num_blocks: int, block_size: int = 4) -> tuple[float, PrefixCache]:
    """Requests one at a time through the KV manager, one simulated second apart; token hit rate."""
    clock = Clock()
    cache = PrefixCache(policy, clock)
    manager = KVCacheManager(num_blocks, block_size, cache)
    hit = query = 0
    for index, prompt in enumerate(prompts):
        clock.now = float(index)
        seq = _Seq(str(index), list(prompt))
        prefix = manager.find_cached_prefix(seq)
        assert manager.allocate_slots(seq.request_id, len(prompt), prefix, seq)
        manager.cache_full_blocks(seq.request_id, len(prompt))
        manager.free(seq.request_id)
        hit, query = hit + prefix.num_tokens, query + len(prompt)
    assert manager.num_free_blocks == num_blocks
    return hit / query, cache


def _hot_set_with_scans(rounds: int = 80) -> list[list[int]]:
    """Two hot 3-block prompts, each reused every 6 requests, between one-off 8-block scans that
    push them out of an LRU cache of 20 blocks."""
    hot = [[1000 + 100 * i + j for j in range(13)] for i in range(2)]
    prompts, fresh = [], 10_000
    for r in range(rounds):
        prompts.append(hot[r % 2])
        for _ in range(2):
            prompts.append(list(range(fresh, fresh + 33)))
            fresh += 33
    return prompts


def test_adaptive_switches_to_the_arm_its_shadows_score_best():
    prompts = _hot_set_with_scans()
    lru_rate, _ = replay(LRUPolicy(), prompts, 20)
    lruk_rate, _ = replay(LRUKPolicy(2, 1000.0), prompts, 20)
    assert lruk_rate > lru_rate + 0.05         # the trace separates the arms
    policy = AdaptivePolicy([LRUPolicy(), LRUKPolicy(2, 1000.0)], 20, epoch_lookups=8)
    rate, cache = replay(policy, prompts, 20)
    snap = policy.snapshot()
    assert snap.num_switches >= 1 and snap.active == "lru-k(k=2,h=1000s)"
    assert snap.shadow_hit_rates["lru-k(k=2,h=1000s)"] > snap.shadow_hit_rates["lru"]
    assert "lru -> lru-k(k=2,h=1000s)" in snap.recent_decisions[0]
    assert rate >= lruk_rate - 0.05            # learning costs a few early misses, no more
    stats = cache.make_stats("adaptive")
    assert stats.active_policy == "lru-k(k=2,h=1000s)" and stats.adaptive.num_switches == snap.num_switches
    assert set(stats.evictions) <= {"lru", "lru-k(k=2,h=1000s)"}


def test_adaptive_stays_put_when_the_active_arm_is_best():
    # Pure recency: a cyclic working set that fits; LRU is optimal and no arm beats it.
    prompts = [[100 * (i % 4) + j for j in range(9)] for i in range(80)]
    policy = AdaptivePolicy([LRUPolicy(), LFUAgePolicy()], 12, epoch_lookups=8)
    rate, _ = replay(policy, prompts, 12)
    assert policy.num_switches == 0 and rate == replay(LRUPolicy(), prompts, 12)[0]


def test_fanout_through_the_kv_manager_and_adaptive_shadows():
    # Block size 4: a 2-block system prompt, three conversations off it, the first one continued.
    system = list(range(1, 9))
    first = system + [100, 101, 102, 103, 104]
    prompts = [first, system + [200, 201, 202, 203, 204], first + [105, 106, 107, 108],
               system + [300, 301, 302, 303, 304]]
    policy = FanoutPolicy(k=2, half_life_s=10.0)
    _, cache = replay(policy, prompts, 32)
    head = [cache._by_hash[h].stats for h in chain_hashes(namespace_root(""), system, 4)]
    # Branches at t=1 and t=3 (request 2 continued request 0's conversation: no branch).
    assert [(stats.branches, stats.newest_branched) for stats in head] == [((1.0,), True)] * 2
    adaptive = AdaptivePolicy([LRUPolicy(), FanoutPolicy(k=2, half_life_s=10.0)], 32)
    _, cache = replay(adaptive, prompts, 32)
    assert cache._track_fanout       # an arm may become active: the real cache keeps fan-out too
    head_hashes = chain_hashes(namespace_root(""), system, 4)
    assert cache._by_hash[head_hashes[0]].stats.branches == (1.0,)
    assert adaptive.arms[1].shadow._stats[head_hashes[1]].branches == (1.0,)


def test_shadow_cache_sampling_keeps_cost_bounded():
    policy = AdaptivePolicy([LRUPolicy()], num_blocks=1_000_000, max_shadow_blocks=1000)
    assert policy.sample_rate == pytest.approx(0.001)
    assert policy.arms[0].shadow.capacity == 1000
    shadow = ShadowCache(LRUPolicy(), 2)
    shadow.use([b"a", b"b", b"c"], [0, 1, 2], 1.0)
    assert len(shadow) == 2 and b"a" in shadow and b"c" not in shadow   # deeper-first on the tie
    assert shadow.prefix_hits([b"a", b"b", b"x"]) == 2


def test_belady_bounds_every_policy_on_the_benchmark_traces():
    """The benchmark's offline optimum really is an upper bound under the same accounting."""
    from kvserve.eval import prefix_sim, prefix_traces
    for make_trace in prefix_traces.TRACES.values():
        trace = make_trace(1, 100)
        capacity = 1 + max(-(-(len(r.prompt) + len(r.output)) // prefix_traces.BLOCK_SIZE) for r in trace)
        best = prefix_sim.simulate_belady(trace, capacity)
        for policy in prefix_sim.POLICIES:
            assert prefix_sim.simulate_policy(trace, capacity, policy)["hit_rate"] <= best + 1e-9, policy
        assert prefix_sim.simulate_dead_first_lru(trace, capacity) <= best + 1e-9
        assert prefix_sim.simulate_shared_last_lru(trace, capacity) <= best + 1e-9


def test_shared_prefix_blocks_are_the_blocks_above_a_branch():
    from kvserve.eval import prefix_sim as pb
    from kvserve.eval.prefix_traces import BLOCK_SIZE as bs, TraceRequest
    system = list(range(1000, 1000 + 3 * bs))                   # three full blocks shared by two chats
    a = TraceRequest(0.0, system + list(range(2 * bs)), [7] * bs)
    a_next = TraceRequest(1.0, a.prompt + a.output + list(range(50, 50 + bs)), [8] * 4)
    b = TraceRequest(2.0, system + list(range(500, 500 + 2 * bs)), [9] * 4)
    shared = pb.shared_prefix_blocks([a, a_next, b])
    system_hashes = chain_hashes(namespace_root(""), system, bs)
    assert shared == set(system_hashes)
    # A linear conversation alone has no branch, so nothing is shared.
    assert pb.shared_prefix_blocks([a, a_next]) == set()


def test_lru_keeping_shared_prefixes_evicts_conversations_first():
    from kvserve.eval import prefix_sim as pb
    from kvserve.eval.prefix_traces import BLOCK_SIZE as bs, TraceRequest
    system_1, system_2 = list(range(1000, 1000 + 4 * bs)), list(range(2000, 2000 + 4 * bs))

    def chat(time: float, system: list[int], k: int):
        return TraceRequest(time, system + list(range(10_000 + 100 * k, 10_000 + 100 * k + 3 * bs)), [5, 5])

    # Two chats on system prompt 1, two on system prompt 2, then one more on system prompt 1. In a
    # 10-block cache plain lru has evicted prompt 1 (least recent) by then; the yardstick keeps it
    # and evicts the chats' own blocks instead, so the last request hits prompt 1.
    trace = [chat(0.0, system_1, 0), chat(1.0, system_1, 1), chat(2.0, system_2, 2), chat(3.0, system_2, 3),
             chat(4.0, system_1, 4)]
    kept = pb.simulate_shared_last_lru(trace, 10)
    assert kept > pb.simulate_policy(trace, 10, "lru")["hit_rate"]
    assert kept <= pb.simulate_belady(trace, 10) + 1e-9


@pytest.mark.parametrize("policy_name", ["lru", "lru-k", "lfu-age"])
def test_one_allocation_evicts_in_policy_order_and_tells_the_write_back_once(policy_name):
    """An allocation that needs several cached blocks evicts them in one call: the same victims,
    in the same order, as one eviction at a time, and the write-back hook hears of them together
    (so the host tier stores them as one copy)."""
    accesses = [("a", 1), ("b", 2), ("c", 3), ("a", 4), ("d", 5), ("b", 6), ("e", 7), ("a", 8)]
    one_at_a_time, batched = Harness(make_policy(policy_name), num_blocks=5), Harness(make_policy(policy_name), num_blocks=5)
    for h in (one_at_a_time, batched):
        for name, t in accesses:
            h.use(name, t)
    expected = one_at_a_time.eviction_order()[:4]
    heard = []
    batched.cache.on_evict = lambda victims: heard.append([batched.names[v.block_id] for v in victims])
    blocks = batched.pool.allocate(4)
    assert [batched.names[block] for block in blocks] == expected
    assert heard == [expected]
    assert sum(batched.cache.evictions.values()) == 4 and batched.cache.num_evictable == 1

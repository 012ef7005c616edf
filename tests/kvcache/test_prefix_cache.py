"""Prefix caching: hashing, verified lookups, partial/full-block hits, no leak (property test),
tenant isolation, pins, cache-aware admission, and outputs with hits equal to cold runs (tiny models,
compared to transformers)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import TEST_DEVICE
from kvserve import SamplingParams
from kvserve.config import SchedulerConfig
from kvserve.engine.engine import Engine
from kvserve.sched.request import Request
from kvserve.sched.scheduler import RequestRejected, Scheduler
from kvserve.kvcache.policies import LRUPolicy
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.prefix_cache import (PrefixCache, chain_hashes, hash_block, make_namespace, namespace_root,
                                          parse_share_groups)

BS = 4


def _request(request_id: str, tokens: list[int], max_tokens: int = 4, namespace: str = "") -> Request:
    request = Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens)
    request.set_cache_namespace(namespace)
    return request


def _manager(num_blocks: int = 32) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, PrefixCache(LRUPolicy()))


def _run_prompt(manager: KVCacheManager, request: Request) -> int:
    """Admits, computes and frees a request's prompt; returns the tokens it got from the cache."""
    hit = manager.find_cached_prefix(request)
    assert manager.allocate_slots(request.request_id, request.num_tokens, hit, request)
    manager.cache_full_blocks(request.request_id, request.num_tokens)
    manager.free(request.request_id)
    return hit.num_tokens


# --------------------------------------------------------------------------------------------------
# hashing and lookups
# --------------------------------------------------------------------------------------------------

def test_chain_hash_covers_the_whole_prefix_and_the_namespace():
    tokens = list(range(12))
    a = chain_hashes(namespace_root("tenant:a"), tokens, BS)
    assert len(a) == 3 and len(a[0]) == 16                       # 128-bit
    assert a == chain_hashes(namespace_root("tenant:a"), tokens + [99], BS)   # partial block not hashed
    changed = chain_hashes(namespace_root("tenant:a"), [7] + tokens[1:], BS)
    assert all(x != y for x, y in zip(a, changed))               # an early token changes every later block
    assert all(x != y for x, y in zip(a, chain_hashes(namespace_root("tenant:b"), tokens, BS)))
    assert a[1] == hash_block(a[0], tokens[4:8])


def test_partial_block_and_full_block_hits():
    manager = _manager()
    base = list(range(100, 112))                                  # 3 full blocks
    assert _run_prompt(manager, _request("a", base + [1, 2])) == 0
    # Shares 6 tokens = 1 full block + 2 tokens of the next: only the full block hits.
    assert _run_prompt(manager, _request("b", base[:6] + [50, 51, 52])) == 4
    # The whole prompt is cached as 3 blocks, but the last token must be computed: 2 blocks hit.
    assert _run_prompt(manager, _request("c", base)) == 8
    # One token past the cached blocks: all 3 hit and only that token is computed.
    assert _run_prompt(manager, _request("d", base + [7])) == 12
    assert manager.num_free_blocks == manager.num_blocks


def test_peek_estimates_the_hit_without_touching_anything():
    manager = _manager()
    base = list(range(100, 112))                                  # 3 full blocks
    _run_prompt(manager, _request("a", base + [1, 2], namespace="tenant:a"))
    cache = manager.prefix_cache
    before = (cache.num_lookups, cache.num_query_tokens, cache.num_hit_tokens)
    for tokens in (base + [7], base, base[:6] + [50, 51], [5] + base):
        expected = manager.find_cached_prefix(_request("q", tokens, namespace="tenant:a")).num_tokens
        assert manager.peek_cached_tokens(tokens, "tenant:a") == expected
    assert (cache.num_lookups, cache.num_query_tokens, cache.num_hit_tokens) == before
    assert manager.peek_cached_tokens(base + [7], "tenant:b") == 0       # another tenant's blocks
    assert KVCacheManager(8, BS, None).peek_cached_tokens(base + [7], "tenant:a") == 0   # caching off


def test_lookup_verifies_tokens_parent_and_namespace():
    manager = _manager()
    cache = manager.prefix_cache
    tokens = list(range(8))
    root = namespace_root("")
    hashes = chain_hashes(root, tokens, BS)
    [block] = manager.pool.allocate(1)
    # A forged entry: the right hash, other tokens (what a hash collision would look like).
    assert cache.insert(block, hashes[0], root, [9, 9, 9, 9], "", 0)
    manager.pool.free([block])
    assert manager.find_cached_prefix(_request("x", tokens + [1])).block_ids == []
    [block2] = manager.pool.allocate(1)
    assert block2 != block
    h = chain_hashes(namespace_root("tenant:t"), tokens, BS)[0]
    assert cache.insert(block2, h, namespace_root("tenant:t"), tokens[:4], "tenant:u", 0)   # wrong namespace
    manager.pool.free([block2])
    assert manager.find_cached_prefix(_request("y", tokens + [1], namespace="tenant:t")).block_ids == []


def test_namespaces_isolate_tenants_unless_configured():
    assert make_namespace("a", None) != make_namespace("b", None)
    assert make_namespace("a", None, "global") == make_namespace("b", None, "global")
    groups = parse_share_groups("a, b; c,d")
    assert make_namespace("a", None, "tenant", groups) == make_namespace("b", None, "tenant", groups)
    assert make_namespace("a", None, "tenant", groups) != make_namespace("c", None, "tenant", groups)
    assert make_namespace("a", "s1") != make_namespace("a", "s2") != make_namespace("a", None)
    with pytest.raises(ValueError):
        parse_share_groups("a,b;b,c")
    manager = _manager()
    prompt = list(range(20, 33))
    assert _run_prompt(manager, _request("a1", prompt, namespace=make_namespace("a", None))) == 0
    assert _run_prompt(manager, _request("b1", prompt, namespace=make_namespace("b", None))) == 0
    assert _run_prompt(manager, _request("a2", prompt, namespace=make_namespace("a", None))) == 12


# --------------------------------------------------------------------------------------------------
# no leak, no wrong content, no cross-tenant hit: random operations
# --------------------------------------------------------------------------------------------------

_BASES = [[1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3, 1, 0, 0, 0, 0], [3, 3, 3, 3, 3, 3, 3, 3]]
operations = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 5), st.integers(0, 2), st.lists(st.integers(0, 3), max_size=9),
              st.integers(0, 2)),
    st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 6)),
    st.tuples(st.just("free"), st.integers(0, 5)),
    st.tuples(st.just("pin"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("tick"), st.floats(0.1, 100.0))), max_size=80)


def _check_invariants(manager: KVCacheManager, live: dict[str, Request]) -> None:
    pool, cache = manager.pool, manager.prefix_cache
    owners = [0] * manager.num_blocks
    for request_id, table in manager.block_tables.items():
        assert len(table) == len(set(table))
        request = live[request_id]
        for index, block in enumerate(table):
            owners[block] += 1
            cached = cache.cached_block(block)
            if cached is not None and index < len(request.block_hashes):
                # A cached block in a table holds exactly that request's tokens, in its namespace.
                assert cached.token_ids == tuple(request.token_ids_between(index * BS, (index + 1) * BS))
                assert cached.namespace == request.cache_namespace
    assert owners == [pool.ref_count(b) for b in range(manager.num_blocks)]
    idle = [b for b in range(manager.num_blocks) if owners[b] == 0]
    evictable = [b for b in idle if cache.holds(b)]
    assert sorted(pool._empty) == sorted(b for b in idle if not cache.holds(b))
    assert cache.num_evictable == len(evictable)
    assert manager.num_free_blocks == len(idle)


@settings(max_examples=250, deadline=None)
@given(num_blocks=st.integers(4, 24), ops=operations)
def test_prefix_cache_never_leaks_or_serves_wrong_content(num_blocks, ops):
    now = [0.0]
    manager = KVCacheManager(num_blocks, BS, PrefixCache(LRUPolicy(), clock=lambda: now[0], max_pinned_blocks=8))
    live: dict[str, Request] = {}
    for op in ops:
        if op[0] == "admit":
            _, rid, base, suffix, tenant = op
            request_id = f"r{rid}"
            if request_id in live:
                continue
            request = _request(request_id, _BASES[base] + suffix, namespace=make_namespace(f"t{tenant}", None))
            hit = manager.find_cached_prefix(request)
            assert hit.num_tokens < request.num_tokens
            for block in hit.block_ids:
                assert manager.prefix_cache.cached_block(block).namespace == request.cache_namespace
            if manager.allocate_slots(request_id, request.num_tokens, hit, request):
                live[request_id] = request
                manager.cache_full_blocks(request_id, request.num_tokens)
        elif op[0] == "grow":
            _, rid, count = op
            request = live.get(f"r{rid}")
            if request is not None:
                new_tokens = [(len(request.output_token_ids) + i) % 4 for i in range(count)]
                if manager.allocate_slots(request.request_id, request.num_tokens + count):
                    request.output_token_ids.extend(new_tokens)
                    manager.cache_full_blocks(request.request_id, request.num_tokens - 1)
        elif op[0] == "free":
            request = live.pop(f"r{op[1]}", None)
            if request is not None:
                manager.free(request.request_id)
        elif op[0] == "pin":
            try:
                manager.pin_prefix(_BASES[op[1]], make_namespace(f"t{op[2]}", None), 10.0)
            except ValueError:
                pass    # over the pinned-blocks limit
        else:
            now[0] += op[1]
        _check_invariants(manager, live)
    for request_id in list(live):
        manager.free(request_id)
    assert manager.num_free_blocks == num_blocks and manager.num_tracked_requests == 0


# --------------------------------------------------------------------------------------------------
# scheduler: admission counts cached blocks; cache-aware order with a starvation bound
# --------------------------------------------------------------------------------------------------

def _step(scheduler: Scheduler) -> list[str]:
    out = scheduler.schedule()
    for item in out.scheduled:
        scheduler.advance(item)
        if item.samples_token:
            scheduler.append_token(item.request, 5, set())
    return [item.request.request_id for item in out.scheduled]


def test_admission_counts_cached_blocks_as_available():
    manager = KVCacheManager(12, BS, PrefixCache(LRUPolicy()))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), manager, max_model_len=48)
    shared = list(range(100, 132))                     # 8 blocks
    first = _request("first", shared + [1], max_tokens=12)
    scheduler.add_request(first)
    assert _step(scheduler) == ["first"]              # 9 blocks of 12 in use, its 8 full ones cached
    # Needs 9 blocks for its prompt: without the cache it could not be admitted next to `first`.
    second = _request("second", shared + [2], max_tokens=4)
    scheduler.add_request(second)
    assert _step(scheduler) == ["first", "second"]
    assert second.num_cached_tokens == 32 and second.num_computed_tokens == 33
    assert manager.block_table("second")[:8] == manager.block_table("first")[:8]
    while scheduler.num_unfinished:
        _step(scheduler)
    assert manager.num_free_blocks == manager.num_blocks


def test_cache_aware_order_prefers_cached_prefixes_but_bounds_bypasses():
    manager = KVCacheManager(64, BS, PrefixCache(LRUPolicy()))
    config = SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=1, cache_aware_scheduling=True,
                             cache_aware_max_bypass=2)
    scheduler = Scheduler(config, manager, max_model_len=64)
    shared = list(range(200, 232))
    warm = _request("warm", shared + [0], max_tokens=1)
    scheduler.add_request(warm)
    while scheduler.num_unfinished:
        _step(scheduler)
    cold = _request("cold", list(range(300, 330)), max_tokens=1)
    scheduler.add_request(cold)
    hits = [_request(f"hit{i}", shared + [i + 1], max_tokens=1) for i in range(4)]
    for request in hits:
        scheduler.add_request(request)
    admitted = []
    while scheduler.num_unfinished:
        for request_id in _step(scheduler):
            if request_id not in admitted:
                admitted.append(request_id)
    # The cached requests overtake the cold one, but only twice.
    assert admitted == ["hit0", "hit1", "cold", "hit2", "hit3"]
    assert cold.num_bypassed == 2


# --------------------------------------------------------------------------------------------------
# engine: outputs with hits equal cold runs and transformers (tiny random models)
# --------------------------------------------------------------------------------------------------

def _engine(folder: str, **options) -> Engine:
    base = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=2 << 20, block_size=16,
                max_model_len=256)
    return Engine.from_options(**{**base, **options})


def _generate(engine: Engine, prompt: list[int], max_tokens: int = 8, **cache_options):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    request_id = engine.add_request(None, {"prompt_token_ids": prompt}, params, **cache_options)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = output
    return final.outputs[0]


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(3)
    base = torch.randint(3, 256, (70,), generator=generator).tolist()
    return {
        "first": base + [5, 6, 7],
        "partial-block": base[:40] + [9, 9, 9],     # hits 2 of the 2.5 shared blocks
        "full-blocks": base[:64],                   # cached 4 blocks, the last is recomputed
        "extends": base + [5, 6, 7, 8, 9, 10],      # hits 4 blocks
        "repeat": base + [5, 6, 7],                 # its own earlier run: 4 blocks + generated ones
    }


def test_outputs_with_hits_equal_cold_runs_and_transformers(tiny_checkpoint, prompts):
    folder, hf_model = tiny_checkpoint
    warm, cold = _engine(folder), _engine(folder, enable_prefix_caching=False)
    expected_hits = {"first": 0, "partial-block": 32, "full-blocks": 48, "extends": 64, "repeat": 64}
    for name, prompt in prompts.items():
        before = warm.prefix.stats.hit_tokens
        hot = _generate(warm, prompt)
        assert warm.prefix.stats.hit_tokens - before == expected_hits[name], name
        ref = _generate(cold, prompt)
        assert hot.token_ids == ref.token_ids == _hf_greedy(hf_model, prompt, 8), name
        for a, b in zip(hot.logprobs, ref.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    stats = warm.prefix.stats
    assert stats.query_tokens == sum(len(p) for p in prompts.values()) and stats.lookups == len(prompts)
    assert cold.prefix.stats.hit_tokens == 0 and cold.kv_manager.prefix_cache is None
    for engine in (warm, cold):
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_hits_under_chunked_prefill_and_preemption(tiny_checkpoint, prompts):
    folder, _ = tiny_checkpoint
    cold = _engine(folder, enable_prefix_caching=False)
    expected = {name: _generate(cold, p, 16).token_ids for name, p in prompts.items()}
    # 10 blocks of 16 tokens, 16-token steps: prompts are chunked and requests preempt each other.
    squeezed = _engine(folder, kv_cache_memory=cold.kv_bytes_per_token * 16 * 10, max_num_batched_tokens=16,
                       max_model_len=96)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ids = {squeezed.add_request(None, {"prompt_token_ids": p}, params): name for name, p in prompts.items()}
    outputs = {}
    while squeezed.has_unfinished_requests():
        for output in squeezed.step():
            if output.finished:
                outputs[ids[output.request_id]] = output.outputs[0].token_ids
    assert outputs == expected
    assert squeezed.scheduler.num_preemptions_total > 0 and squeezed.prefix.stats.hit_tokens > 0
    assert squeezed.kv_manager.num_free_blocks == squeezed.kv_manager.num_blocks


def test_prompt_logprobs_skip_the_cache_and_match(tiny_checkpoint, prompts):
    folder, _ = tiny_checkpoint
    warm, cold = _engine(folder), _engine(folder, enable_prefix_caching=False)
    prompt = prompts["first"]
    _generate(warm, prompt)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)

    def prompt_logprobs(engine):
        request_id = engine.add_request(None, {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id and output.finished:
                    return output.prompt_logprobs
    hits_before = warm.prefix.stats.hit_tokens
    got, ref = prompt_logprobs(warm), prompt_logprobs(cold)
    assert warm.prefix.stats.hit_tokens == hits_before
    assert len(got) == len(ref) == len(prompt) and got[0] is None
    for a, b in zip(got[1:], ref[1:]):
        assert all(abs(a[t] - b[t]) < 1e-4 for t in b)


def test_tenants_salts_and_sharing_in_the_engine(tiny_checkpoint, prompts):
    folder, _ = tiny_checkpoint
    engine = _engine(folder)
    prompt = prompts["first"]

    def hits(**options) -> int:
        before = engine.prefix.stats.hit_tokens
        _generate(engine, prompt, 2, **options)
        return engine.prefix.stats.hit_tokens - before

    assert hits(tenant="a") == 0
    assert hits(tenant="b") == 0                    # never another tenant's prefix
    assert hits() == 0                              # nor the anonymous one's
    assert hits(tenant="a") == 64
    assert hits(tenant="a", cache_salt="s") == 0    # a salt is its own namespace
    assert hits(tenant="a", cache_salt="s") == 64
    # Passed through a prompt dict, the way the server does.
    before = engine.prefix.stats.hit_tokens
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request(None, {"prompt_token_ids": prompt, "tenant": "b"}, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.prefix.stats.hit_tokens - before == 64
    with pytest.raises(RequestRejected, match="tenant"):
        engine.add_request(None, {"prompt_token_ids": prompt, "tenant": "a"}, params, tenant="b")
    with pytest.raises(RequestRejected, match="pin_ttl"):
        engine.add_request(None, prompt, params, pin_ttl=-1.0)

    shared = _engine(folder, prefix_sharing="global")
    _generate(shared, prompt, 2, tenant="a")
    before = shared.prefix.stats.hit_tokens
    _generate(shared, prompt, 2, tenant="b")
    assert shared.prefix.stats.hit_tokens - before == 64
    grouped = _engine(folder, prefix_share_groups="a,b")
    _generate(grouped, prompt, 2, tenant="a")
    _generate(grouped, prompt, 2, tenant="c")
    assert grouped.prefix.stats.hit_tokens == 0
    _generate(grouped, prompt, 2, tenant="b")
    assert grouped.prefix.stats.hit_tokens == 64


def test_pinned_prefix_survives_pressure_that_evicts_unpinned_ones(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    probe = _engine(folder)
    # 12 blocks: each 48-token prompt + 8 outputs takes 4 of them.
    engine = _engine(folder, kv_cache_memory=probe.kv_bytes_per_token * 16 * 12, max_model_len=64,
                     eviction_policy="lru")
    generator = torch.Generator().manual_seed(5)
    system, control = (torch.randint(3, 256, (48,), generator=generator).tolist() for _ in range(2))
    _generate(engine, system + [1], pin_ttl=600.0, pin_prefix_tokens=48)
    _generate(engine, control + [1])                  # same shape, more recent, not pinned
    assert engine.prefix.stats.pinned_blocks == 3
    for i in range(6):                                # fill the cache with other prompts
        _generate(engine, torch.randint(3, 256, (49,), generator=generator).tolist())
    assert engine.prefix.stats.evictions["lru"] > 0

    def hits(prompt):
        before = engine.prefix.stats.hit_tokens
        _generate(engine, prompt + [2])
        return engine.prefix.stats.hit_tokens - before
    assert hits(control) == 0
    assert hits(system) == 48
    [pin] = engine.prefix.pins()
    assert pin.num_blocks == 3 and pin.num_cached_blocks == 3 and 0 < pin.expires_in_s <= 600
    assert not engine.unpin_prefix(pin.pin_id, tenant="someone-else")
    assert engine.unpin_prefix(pin.pin_id)
    assert engine.prefix.pins() == [] and engine.prefix.stats.pinned_blocks == 0
    info = engine.pin_prefix({"prompt_token_ids": control}, 60.0, tenant="t")
    assert (info.num_tokens, info.num_blocks, info.num_cached_blocks) == (48, 3, 0)
    with pytest.raises(ValueError, match="full block"):
        engine.pin_prefix({"prompt_token_ids": control[:10]}, 60.0)
    with pytest.raises(ValueError, match="limit"):
        engine.pin_prefix({"prompt_token_ids": control + system}, 60.0, tenant="u")   # over half the cache


def test_flags_turn_prefix_caching_off_and_pick_a_policy():
    from kvserve.cli import build_parser
    from kvserve.config import EngineConfig, engine_options_from_args
    args = build_parser().parse_args(["generate", "x", "--no-prefix-caching", "--eviction-policy", "lru-k",
                                      "--lru-k", "3", "--heat-half-life-s", "30", "--cache-aware-scheduling"])
    options = engine_options_from_args(args)
    assert options["enable_prefix_caching"] is False and options["eviction_policy"] == "lru-k"
    assert options["lru_k"] == 3 and options["heat_half_life_s"] == 30.0 and options["cache_aware_scheduling"]
    default = engine_options_from_args(build_parser().parse_args(["generate", "x"]))
    assert default["enable_prefix_caching"] is True and default["eviction_policy"] == "lru"
    assert engine_options_from_args(build_parser().parse_args(
        ["generate", "x", "--eviction-policy", "fanout"]))["eviction_policy"] == "fanout"
    assert engine_options_from_args(build_parser().parse_args(
        ["generate", "x", "--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
    for bad in (dict(eviction_policy="fifo"), dict(lru_k=9), dict(heat_half_life_s=0), dict(max_pinned_fraction=2)):
        with pytest.raises(ValueError):
            EngineConfig.from_options(**bad)


"""The host KV tier (--kv-host-memory): blocks the GPU prefix cache evicts are written back to a host
store in their stored format and loaded back on a later prefix hit; the tokens equal a cold run."""

from __future__ import annotations

import pytest

from conftest import TEST_DEVICE, ManagerSequence as _Seq, build_tiny_checkpoint
from kvserve import LLM, SamplingParams
from kvserve.kvcache.host_tier import HostTier
from kvserve.kvcache.prefix_cache import hash_block

BLOCK = 4
PROMPT = [3 + (7 * i) % 200 for i in range(41)]          # 10 full blocks + 1 token
FILLERS = [[11 + (13 * i + 5 * j) % 230 for i in range(41)] for j in range(4)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FORMATS = {"fp32": {}, "bf16": dict(kv_cache_dtype="bf16"), "int8": dict(kv_cache_dtype="int8"),
           "fp8": dict(kv_cache_dtype="fp8_e4m3"),
           "int4-no-window": dict(kv_cache_dtype="int4", kv_quant_window=0, kv_quant_sinks=0)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("host-tier-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


def _llm(folder: str, host_blocks: int, **options) -> LLM:
    probe = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, **options)
    block_bytes = probe.engine.kv_bytes_per_token * BLOCK
    # Room for one request and a little: each filler evicts what the one before left cached.
    return LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=block_bytes * 16,
               kv_host_memory=block_bytes * host_blocks, async_scheduling="off", **options)


def _tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_prefix_evicted_to_host_comes_back_with_the_same_tokens(folder, name):
    """A host hit gives the tokens a GPU-cache hit gives. For the exact format (fp32 KV of an fp32
    model) that is also the cold run's; a lossy format's hit reads the prefix back from its stored
    format where a cold prefill attends over its own full-precision K/V, so there the reference is
    the GPU hit (docs/kv_tiers.md)."""
    options = FORMATS[name]
    llm = _llm(folder, host_blocks=64, **options)
    cold = _tokens(llm, PROMPT)
    warm = _tokens(llm, PROMPT)                             # a GPU-cache hit
    assert llm.engine.make_stats().prefix_cache.hit_tokens == 10 * BLOCK
    for filler in FILLERS:
        _tokens(llm, filler)
    host = llm.engine.make_stats().kv_cache.host
    assert host.blocks_written >= 10 and host.hit_tokens == 0
    assert _tokens(llm, PROMPT) == warm
    host = llm.engine.make_stats().kv_cache.host
    assert host.hit_tokens == 10 * BLOCK and host.blocks_loaded == 10
    if name == "fp32":
        assert warm == cold


def test_a_second_request_on_blocks_being_loaded_waits_and_hits_the_gpu_cache(folder):
    """Two requests that reach the same evicted prefix at once: the first loads it from the host,
    the second waits for it to be published and hits the GPU cache, so the blocks cross the link
    once. Both give the cold run's tokens."""
    probe = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20)
    block_bytes = probe.engine.kv_bytes_per_token * BLOCK
    # Room for both requests loading their own copy (2 x 13 blocks), so only the wait keeps the
    # second from loading.
    llm = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=block_bytes * 40,
              kv_host_memory=block_bytes * 128, async_scheduling="off")
    cold = _tokens(llm, PROMPT)
    fillers = FILLERS + [[17 + (19 * i + 3 * j) % 220 for i in range(41)] for j in range(3)]
    for filler in fillers:
        _tokens(llm, filler)
    stats = llm.engine.make_stats()
    assert stats.kv_cache.host.hit_tokens == 0
    gpu_hits_before = stats.prefix_cache.hit_tokens
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [cold, cold]
    stats = llm.engine.make_stats()
    host = stats.kv_cache.host
    assert host.hit_tokens == 10 * BLOCK and host.blocks_loaded == 10      # loaded once
    assert host.loads_joined == 1
    assert stats.prefix_cache.hit_tokens - gpu_hits_before == 10 * BLOCK  # the second's GPU hit


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_a_prefix_cached_on_the_gpu_again_after_a_host_stretch_is_hit_past_it(folder, policy):
    """GPU, then host, then GPU: with a stretch from the middle of a cached prefix evicted to the
    host (a tenant's quota eviction keeps the blocks a hit needs and takes others), a later hit
    takes the head from the GPU, loads the stretch and takes the tail from the GPU too, instead of
    recomputing the tail; the tokens are the cold run's. Under write-through the host holds the
    tail too: it still comes from the GPU (the stretch ends where the GPU has the prefix again)."""
    probe = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20)
    block_bytes = probe.engine.kv_bytes_per_token * BLOCK
    llm = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=block_bytes * 40,
              kv_host_memory=block_bytes * 64, async_scheduling="off", kv_host_write_policy=policy)
    cold = _tokens(llm, PROMPT)
    manager = llm.engine.kv_manager
    cache = manager.prefix_cache
    by_tokens = {cached.token_ids: block_id for block_id, cached in cache._by_block.items()}
    prompt_blocks = [by_tokens[tuple(PROMPT[i * BLOCK:(i + 1) * BLOCK])] for i in range(10)]
    middle = prompt_blocks[3:6]
    assert manager.pool.evict_own(None, 3, keep=set(cache._by_block) - set(middle)) == 3
    stats = llm.engine.make_stats()
    gpu_hits_before = stats.prefix_cache.hit_tokens
    assert _tokens(llm, PROMPT) == cold
    stats = llm.engine.make_stats()
    assert stats.kv_cache.host.hit_tokens == 3 * BLOCK                    # the stretch, loaded
    assert stats.prefix_cache.hit_tokens - gpu_hits_before == 7 * BLOCK    # head and tail, as they were


def test_loaded_blocks_are_the_written_bytes(folder):
    """Scribbling over the host copy changes the tokens of the next hit: what comes back is what the
    host store holds, not KV that happened to survive on the GPU."""
    llm = _llm(folder, host_blocks=64)
    cold = _tokens(llm, PROMPT)
    for filler in FILLERS:
        _tokens(llm, filler)
    store = llm.engine.host_store
    import torch
    store.write_blocks(range(store.num_blocks),
                       torch.randint(0, 256, (store.num_blocks, store.block_nbytes), dtype=torch.uint8))
    assert _tokens(llm, PROMPT) != cold


def test_host_tier_needs_prefix_caching(folder, caplog):
    llm = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, kv_host_memory=1 << 20,
              enable_prefix_caching=False)
    assert llm.engine.host_store is None and "host KV tier is off" in caplog.text
    with pytest.raises(ValueError, match="kv_host_memory"):
        LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, kv_host_memory=-1)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, kv_host_memory=8)
    with pytest.raises(ValueError, match=r"kv_host_memory of 1000000000000000 bytes exceeds the host memory available now \(\d+"):
        LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, kv_host_memory=10 ** 15)


def test_available_host_memory_reads_meminfo(tmp_path):
    from kvserve.worker.memory_profile import available_host_memory
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   20480000 kB\n")
    assert available_host_memory(str(meminfo)) == 20480000 * 1024
    assert available_host_memory(str(tmp_path / "missing")) is None


def _chain(n: int, start: int = 0) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
    parent, out = b"root", []
    for i in range(n):
        tokens = (start + i,) * BLOCK
        block_hash = hash_block(parent, tokens)
        out.append((block_hash, parent, tokens))
        parent = block_hash
    return out


def test_host_tier_lookup_verifies_and_evicts_least_recently_used():
    tier = HostTier(3)
    chain = _chain(4)
    ids = [tier.store(h, p, t, "ns") for h, p, t in chain[:3]]
    assert sorted(ids) == [0, 1, 2]
    assert tier.store(*chain[0], "ns") is None           # already held: one copy suffices
    hashes = [h for h, _, _ in chain]
    tokens = lambda i: chain[i][2]                        # noqa: E731
    assert tier.lookup(hashes, tokens, b"root", "ns", 0, 4) == ids
    assert tier.lookup(hashes, tokens, b"root", "other", 0, 4) == []      # namespaces never mix
    assert tier.lookup(hashes, lambda i: (99,) * BLOCK, b"root", "ns", 0, 4) == []   # tokens verified
    tier.lookup(hashes, tokens, b"root", "ns", 1, 3)      # blocks 1, 2 used last: block 0 is the oldest
    assert tier.store(*chain[3], "ns") == ids[0] and not tier.holds(chain[0][0])
    assert tier.make_stats().blocks_evicted == 1


def test_host_blocks_being_loaded_are_not_overwritten_in_the_same_step():
    tier = HostTier(2)
    chain = _chain(4)
    a, b = (tier.store(h, p, t, "ns") for h, p, t in chain[:2])
    tier.begin_load([a, b], BLOCK)
    assert tier.store(*chain[2], "ns") is None and tier.make_stats().writes_dropped == 1
    tier.end_step()
    assert tier.store(*chain[3], "ns") in (a, b)


@pytest.mark.parametrize("seed", range(6))
def test_no_block_leaks_under_random_allocate_evict_load(seed):
    """Random requests over a few shared prefixes through a small GPU pool and a smaller host tier,
    with ticketed copies landing 0-3 steps after they are issued (some failing) and requests freed
    while their loads are in flight: every copy names blocks in range, a load reads a host block
    that holds the hash the request asked for (copies run in issue order, as on the worker's one
    transfer stream), and once every request is gone both pools account for every block."""
    import random

    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.kvstore import DEVICE_STORE, HOST_STORE
    from kvserve.kvcache.policies import make_policy
    from kvserve.kvcache.prefix_cache import PrefixCache
    rng = random.Random(seed)
    num_blocks, host_blocks = 24, 10
    cache = PrefixCache(make_policy("lru", num_blocks=num_blocks))
    tier = HostTier(host_blocks)
    manager = KVCacheManager(num_blocks, BLOCK, cache, tier)
    prefixes = [[rng.randrange(50) for _ in range(BLOCK * rng.randint(1, 6))] for _ in range(5)]
    live: dict[str, _Seq] = {}
    host_content: dict[int, bytes] = {}         # host block -> the hash last written into it
    swapped: dict[str, _Seq] = {}
    inflight: list[tuple[int, int, bool]] = []  # (ticket, step it lands at, landed or failed)

    def land(due: int) -> None:
        for ticket, at, ok in [t for t in inflight if t[1] <= due]:
            inflight.remove((ticket, at, ok))
            recompute = manager.complete_transfer(ticket, ok)
            if recompute is not None:               # its KV is gone: it would be queued to recompute
                live.pop(recompute, None)
                swapped.pop(recompute, None)
                manager.free(recompute)

    for step in range(300):
        land(step)
        expected: dict[int, bytes] = {}         # host block -> what a load this step must find there
        if live and rng.random() < 0.1:
            request_id = rng.choice(sorted(live))
            if not manager.is_loading(request_id) and manager.swap_out(request_id):
                swapped[request_id] = live.pop(request_id)
        elif swapped and rng.random() < 0.3:
            request_id = rng.choice(sorted(swapped))
            if rng.random() < 0.3:
                manager.free(request_id)               # aborted while swapped out
                swapped.pop(request_id)
            else:
                expected = {host_id: b"swapped:" + request_id.encode() for host_id in manager._swapped[request_id][0]}
                if manager.allocate_slots(request_id, swapped[request_id].num_tokens):
                    live[request_id] = swapped.pop(request_id)
        elif live and (rng.random() < 0.45 or manager.num_free_blocks < 8):
            request_id = rng.choice(sorted(live))
            seq = live.pop(request_id)
            manager.cache_full_blocks(request_id, seq.num_tokens)
            manager.free(request_id)
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            seq = _Seq(f"r{step}", tokens)
            hit = manager.find_cached_prefix(seq)
            expected = {host_id: seq.block_hashes[len(hit.block_ids) + i] for i, host_id in enumerate(hit.host_block_ids)}
            if rng.random() < 0.5 and manager.waits_for_incoming(seq.request_id, hit):
                # Another request brings these host blocks in (as the scheduler would, it waits).
                assert any(manager._incoming.get(h) in live for h in hit.host_block_ids)
            elif manager.allocate_slots(seq.request_id, seq.num_tokens, hit, seq):
                live[seq.request_id] = seq
        swapping_out = {host_id: request_id for request_id, (ids, _) in manager._swapped.items() for host_id in ids}
        for copy in manager.take_block_copies():
            if copy.ticket is not None:
                inflight.append((copy.ticket, step + rng.randint(0, 3), rng.random() > 0.05))
            for src, dst in zip(copy.src_block_ids, copy.dst_block_ids):
                if copy.source == DEVICE_STORE:
                    assert copy.destination == HOST_STORE and 0 <= src < num_blocks and 0 <= dst < host_blocks
                    owner = swapping_out.get(dst)
                    host_content[dst] = (b"swapped:" + owner.encode() if owner is not None else
                                         next(b.block_hash for b in tier._by_hash.values() if b.host_id == dst))
                else:
                    assert 0 <= dst < num_blocks
                    assert host_content[src] == expected[src]
        assert manager.pool.num_used_blocks + manager.num_free_blocks == num_blocks
        held = sum(len(ids) for ids, _ in manager._swapped.values())
        assert tier.num_used_blocks + len(tier._free) + held == host_blocks
        assert len({b.host_id for b in tier._by_hash.values()}) == tier.num_used_blocks
    for request_id in list(live) + list(swapped):
        manager.free(request_id)
    manager.take_block_copies()
    # Freed while loading: their tables are held until the copy lands.
    loading = any(manager._transfers[ticket].purpose != "swap-out" for ticket, _, _ in inflight)
    assert (manager.num_free_blocks < num_blocks) == loading
    land(10 ** 9)
    assert manager.num_free_blocks == num_blocks
    assert not manager._incoming and not manager._incoming_of       # nothing is being brought in
    assert tier.num_used_blocks + len(tier._free) == host_blocks
    stats = tier.make_stats()
    assert stats.blocks_loaded > 0 and stats.blocks_written > 0 and stats.swapped_in > 0


@pytest.mark.parametrize("name", ["fp32", "int8"])
def test_swap_preemption_gives_the_tokens_of_running_alone(folder, name):
    """--preemption-mode swap: preempted requests' KV goes to the host tier and comes back on resume
    (not recomputed); every request's greedy tokens equal its run alone."""
    options = FORMATS[name]
    prompts = [[5 + (3 * i + 11 * j) % 240 for i in range(14 + 3 * j)] for j in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    probe = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, **options)
    alone = [probe.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    block_bytes = probe.engine.kv_bytes_per_token * BLOCK
    llm = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=block_bytes * 24,
              kv_host_memory=block_bytes * 96, preemption_mode="swap", enable_prefix_caching=True,
              async_scheduling="off", **options)
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    stats = llm.engine.make_stats()
    assert stats.scheduler.num_preemptions_total > 0
    assert stats.kv_cache.host.swapped_out > 0 and stats.kv_cache.host.swapped_in == stats.kv_cache.host.swapped_out
    assert batched == alone
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_auto_preemption_swaps_when_the_copy_is_cheaper(folder):
    """--preemption-mode auto on CPU: copying a request's KV to host memory and back is measured far
    cheaper than recomputing it, so preempted requests swap; tokens equal their runs alone."""
    prompts = [[5 + (3 * i + 11 * j) % 240 for i in range(14 + 3 * j)] for j in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    probe = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20)
    alone = [probe.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    block_bytes = probe.engine.kv_bytes_per_token * BLOCK
    llm = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=block_bytes * 24,
              kv_host_memory=block_bytes * 96, preemption_mode="auto", async_scheduling="off")
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    cost = llm.engine.preemption_cost
    assert cost.transfer_bytes_per_s > 0 and cost.num_swap_choices > 0
    assert llm.engine.make_stats().kv_cache.host.swapped_out == cost.num_swap_choices
    assert batched == alone


def test_swap_preemption_needs_the_host_tier(folder):
    with pytest.raises(ValueError, match="kv_host_memory"):
        LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, kv_host_memory=0,
            preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode auto needs the host KV tier"):
        LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, kv_host_memory=0,
            preemption_mode="auto")
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, preemption_mode="sideways")


def test_write_through_copies_each_full_block_once(folder):
    """write-through: blocks go to the host as soon as they are full; evicting them later copies
    nothing more, and a host hit still gives the GPU hit's tokens."""
    llm = _llm(folder, host_blocks=64, kv_host_write_policy="write-through")
    cold = _tokens(llm, PROMPT)
    warm = _tokens(llm, PROMPT)
    written = llm.engine.make_stats().kv_cache.host.blocks_written
    assert written >= 10                         # the prompt's 10 full blocks (and full output blocks)
    for filler in FILLERS:
        _tokens(llm, filler)
    assert _tokens(llm, PROMPT) == warm
    host = llm.engine.make_stats().kv_cache.host
    assert host.hit_tokens == 10 * BLOCK
    # Only the fillers' blocks were written since: each full block once, none again at eviction.
    filler_blocks = sum((len(f) + PARAMS.max_tokens - 1) // BLOCK for f in FILLERS)
    assert host.blocks_written - written <= filler_blocks
    assert cold == warm


def test_write_through_does_not_offer_loaded_blocks_back_to_the_host(folder):
    """Blocks loaded from the host are already there: publishing them to the GPU cache after the
    load must not queue them for another write-through (a 32k-token load is 2,048 blocks of
    bookkeeping on the step)."""
    llm = _llm(folder, host_blocks=64, kv_host_write_policy="write-through")
    warm = _tokens(llm, PROMPT)
    for filler in FILLERS:
        _tokens(llm, filler)
    host_tier = llm.engine.kv_manager.host_tier
    offered: list[tuple[int, ...]] = []
    store_many = host_tier.store_many

    def recording_store_many(blocks, *args, **kwargs):
        offered.extend(tuple(block.token_ids) for block in blocks)
        return store_many(blocks, *args, **kwargs)

    host_tier.store_many = recording_store_many
    assert _tokens(llm, PROMPT) == warm
    assert llm.engine.make_stats().kv_cache.host.hit_tokens == 10 * BLOCK
    loaded = {tuple(PROMPT[i * BLOCK:(i + 1) * BLOCK]) for i in range(10)}
    assert offered, "the request's new full blocks are still written through"
    assert not loaded & set(offered)


def test_selective_writes_back_only_blocks_used_often_enough(folder):
    """selective (min uses 2): a prompt used once is not copied when evicted, so it is recomputed;
    one used twice is copied and comes back from the host."""
    llm = _llm(folder, host_blocks=64, kv_host_write_policy="selective", kv_host_min_uses=2)
    _tokens(llm, PROMPT)
    for filler in FILLERS:
        _tokens(llm, filler)
    assert llm.engine.make_stats().kv_cache.host.blocks_written == 0      # every block was used once
    warm_first = _tokens(llm, PROMPT)                                         # recomputed: nothing on the host
    assert llm.engine.make_stats().kv_cache.host.hit_tokens == 0
    _tokens(llm, PROMPT)                                                      # a GPU hit: used twice now
    for filler in FILLERS:
        _tokens(llm, filler)
    host = llm.engine.make_stats().kv_cache.host
    assert host.blocks_written >= 10
    assert _tokens(llm, PROMPT) == warm_first and llm.engine.make_stats().kv_cache.host.hit_tokens == 10 * BLOCK


def test_a_load_waits_for_the_step_in_flight_only_into_blocks_it_may_touch():
    """A load into blocks nobody freed or published since the last step's copies starts at once,
    evicted from the prefix cache or not; one into blocks freed in that window (the step in flight
    may still write them) waits."""
    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.kvstore import DEVICE_STORE
    from kvserve.kvcache.policies import make_policy
    from kvserve.kvcache.prefix_cache import PrefixCache
    tier = HostTier(8)
    manager = KVCacheManager(4, BLOCK, PrefixCache(make_policy("lru", num_blocks=4)), tier)
    tokens = [7] * (3 * BLOCK) + [1]

    def admit(request_id: str):
        seq = _Seq(request_id, tokens)
        hit = manager.find_cached_prefix(seq)
        assert len(hit.host_block_ids) == 3
        assert manager.allocate_slots(request_id, seq.num_tokens, hit, seq)
        (load,) = manager.take_block_copies()
        manager.complete_transfer(load.ticket, ok=True)
        return load

    seq = _Seq("warm", tokens)
    manager.find_cached_prefix(seq)
    for index, block_hash in enumerate(seq.block_hashes):      # the prefix is on the host only
        parent = seq.block_hashes[index - 1] if index else seq.cache_root
        tier.store(block_hash, parent, tokens[index * BLOCK:(index + 1) * BLOCK], seq.cache_namespace)
    first = admit("a")
    assert not first.after_inflight                  # fresh blocks: starts at once
    manager.free("a")                                # its blocks are reused by the next load
    second = admit("b")
    assert set(second.dst_block_ids) & set(first.dst_block_ids) and second.after_inflight
    # Freed, then evicted a step later for another prefix's load: the step in flight (issued after
    # the free) has none of those blocks, so the load starts at once.
    other = [9] * (3 * BLOCK) + [1]
    seq = _Seq("warm-other", other)
    manager.find_cached_prefix(seq)
    for index, block_hash in enumerate(seq.block_hashes):
        parent = seq.block_hashes[index - 1] if index else seq.cache_root
        tier.store(block_hash, parent, other[index * BLOCK:(index + 1) * BLOCK], seq.cache_namespace)
    manager.cache_full_blocks("b", 3 * BLOCK)        # its loaded blocks join the prefix cache
    manager.free("b")
    assert manager.take_block_copies() == []        # the step that frees them is issued
    evicted_before = sum(manager.prefix_cache.evictions.values())
    seq = _Seq("c", other)
    hit = manager.find_cached_prefix(seq)
    assert len(hit.host_block_ids) == 3
    assert manager.allocate_slots("c", seq.num_tokens, hit, seq)
    (third,) = [copy for copy in manager.take_block_copies() if copy.destination == DEVICE_STORE]
    assert sum(manager.prefix_cache.evictions.values()) > evicted_before
    assert set(third.dst_block_ids) & set(second.dst_block_ids) and not third.after_inflight


def test_a_load_takes_evicted_blocks_before_blocks_freed_under_the_step_in_flight():
    """Blocks a finished request freed are still in the step in flight; a load placed in them
    would wait for that step, so it takes other empty blocks, then evicts cached ones."""
    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.kvcache.policies import make_policy
    from kvserve.kvcache.prefix_cache import PrefixCache
    from kvserve.kvstore import DEVICE_STORE
    tier = HostTier(8)
    manager = KVCacheManager(8, BLOCK, PrefixCache(make_policy("lru", num_blocks=8)), tier)
    cached = _Seq("x", [5] * (3 * BLOCK) + [1])     # three blocks left in the prefix cache
    manager.find_cached_prefix(cached)
    assert manager.allocate_slots("x", cached.num_tokens, None, cached)
    manager.cache_full_blocks("x", 3 * BLOCK)
    manager.free("x")
    manager.take_block_copies()                     # a step boundary
    tokens = [7] * (3 * BLOCK) + [1]
    seq = _Seq("warm", tokens)
    manager.find_cached_prefix(seq)
    for index, block_hash in enumerate(seq.block_hashes):      # the prefix is on the host only
        parent = seq.block_hashes[index - 1] if index else seq.cache_root
        tier.store(block_hash, parent, tokens[index * BLOCK:(index + 1) * BLOCK], seq.cache_namespace)

    def admit(request_id: str):
        seq = _Seq(request_id, tokens)
        hit = manager.find_cached_prefix(seq)
        assert len(hit.host_block_ids) == 3
        assert manager.allocate_slots(request_id, seq.num_tokens, hit, seq)
        (load,) = [copy for copy in manager.take_block_copies() if copy.destination == DEVICE_STORE]
        manager.complete_transfer(load.ticket, ok=True)
        return load

    first = admit("a")
    manager.free("a")                               # freed: the step in flight may still use them
    evicted_before = sum(manager.prefix_cache.evictions.values())
    second = admit("b")
    assert not set(second.dst_block_ids) & set(first.dst_block_ids)
    assert not second.after_inflight
    assert sum(manager.prefix_cache.evictions.values()) > evicted_before


def test_a_write_back_says_how_deep_each_block_is_in_its_prefix():
    """An eviction's write-back carries each block's depth in its chain: cut short under back-pressure,
    the worker drops the deep end, not the blocks every hit on the prefix passes through."""
    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.kvcache.policies import make_policy
    from kvserve.kvcache.prefix_cache import PrefixCache
    from kvserve.kvstore import DEVICE_STORE, HOST_STORE, WRITE_BACK
    manager = KVCacheManager(4, BLOCK, PrefixCache(make_policy("lru", num_blocks=4)), HostTier(8))
    seq = _Seq("a", [7] * (3 * BLOCK) + [1])
    assert manager.allocate_slots("a", seq.num_tokens, manager.find_cached_prefix(seq), seq)
    manager.cache_full_blocks("a", seq.num_tokens)
    table = list(manager.block_table("a"))
    manager.free("a")
    manager.take_block_copies()
    other = _Seq("b", [9] * (3 * BLOCK) + [2])
    assert manager.allocate_slots("b", other.num_tokens, manager.find_cached_prefix(other), other)
    (write_back,) = [copy for copy in manager.take_block_copies() if copy.purpose == WRITE_BACK]
    assert (write_back.source, write_back.destination) == (DEVICE_STORE, HOST_STORE)
    depth_of = {block_id: depth for depth, block_id in enumerate(table[:3])}
    assert sorted(write_back.src_block_ids) == sorted(depth_of)
    assert write_back.depths == tuple(depth_of[block_id] for block_id in write_back.src_block_ids)


def test_the_default_write_policy_is_write_through_on_cuda_and_with_a_cold_tier():
    from kvserve.kvcache.host_tier import default_write_policy
    assert default_write_policy("cpu", has_cold_tier=False) == "write-back"
    assert default_write_policy("cpu", has_cold_tier=True) == "write-through"
    assert default_write_policy("cuda", has_cold_tier=False) == "write-through"


def test_an_engine_without_a_configured_policy_takes_the_default_for_its_device(folder):
    from kvserve.kvcache.host_tier import default_write_policy
    llm = _llm(folder, host_blocks=64)
    manager = llm.engine.kv_manager
    expected = default_write_policy(llm.engine.device.type, has_cold_tier=False)
    assert manager.write_through == (expected == "write-through")

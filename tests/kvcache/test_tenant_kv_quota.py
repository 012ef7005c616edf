"""Tenant KV quotas (`kv_quota_blocks` / `kv_quota_fraction` in --qos-config): a tenant's resident
GPU blocks (running plus cached prefixes) are held to its quota. At the quota its allocations evict
its own cached blocks first, then fail (it waits), so it cannot push another tenant's cached prefix
out; a tenant under its quota allocates as before."""

from __future__ import annotations

import pytest

from conftest import TEST_DEVICE, ManagerSequence as _Seq, build_tiny_checkpoint
from kvserve import LLM, SamplingParams
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.policies import make_policy
from kvserve.kvcache.prefix_cache import PrefixCache
from kvserve.sched.qos_config import load_qos_config

BLOCK = 4


def _run(manager: KVCacheManager, request_id: str, tenant: str, tokens: list[int]) -> bool:
    """Admits, computes (publishes) and frees one request; False if it could not be admitted."""
    seq = _Seq(request_id, tokens, tenant)
    if not manager.allocate_slots(request_id, len(tokens), manager.find_cached_prefix(seq), seq, tenant=tenant):
        return False
    manager.cache_full_blocks(request_id, len(tokens))
    manager.free(request_id)
    return True


def _cached_blocks(manager: KVCacheManager, tenant: str, tokens: list[int]) -> int:
    """Blocks of the prompt a new request would find cached (never the last: it is recomputed)."""
    return len(manager.find_cached_prefix(_Seq("probe", tokens, tenant)).block_ids)


def _prompt(seed: int) -> list[int]:
    return [1 + (seed * 31 + 7 * i) % 97 for i in range(6 * BLOCK)]      # 6 full blocks


@pytest.mark.parametrize("quota", [None, 6])
def test_a_tenant_at_its_quota_evicts_its_own_prefixes_not_another_tenants(quota):
    manager = KVCacheManager(12, BLOCK, PrefixCache(make_policy("lru", num_blocks=12)))
    if quota is not None:
        manager.tenant_kv_quotas = {"a": quota}
    assert _run(manager, "b1", "b", _prompt(1))           # b's prefix: cached, least recently used
    assert _run(manager, "a1", "a", _prompt(2))           # the pool is now full of cached blocks
    assert manager.kv_blocks_of("a") == 6 and manager.kv_blocks_of("b") == 6
    assert _run(manager, "a2", "a", _prompt(3))
    if quota is None:       # plain LRU: a's new request pushed b's older prefix out
        assert _cached_blocks(manager, "b", _prompt(1)) == 0
        assert _cached_blocks(manager, "a", _prompt(2)) == 5
    else:                   # at its quota, a evicted its own older prefix instead
        assert _cached_blocks(manager, "b", _prompt(1)) == 5
        assert _cached_blocks(manager, "a", _prompt(2)) == 0
        assert manager.kv_blocks_of("a") == 6
    assert _cached_blocks(manager, "a", _prompt(3)) == 5


def test_a_tenant_whose_running_blocks_fill_its_quota_waits_while_others_run():
    manager = KVCacheManager(16, BLOCK, PrefixCache(make_policy("lru", num_blocks=16)))
    manager.tenant_kv_quotas = {"a": 4}
    assert manager.allocate_slots("a1", 3 * BLOCK + 1, tenant="a")       # 4 blocks, running
    assert manager.quota_shortfall("a", 1) == 1
    assert not manager.allocate_slots("a2", 2, tenant="a")                # over the quota: waits
    assert not manager.allocate_slots("a1", 4 * BLOCK + 1)                # nor may a1 grow (its tenant is known)
    assert manager.allocate_slots("b1", 8 * BLOCK, tenant="b")            # b has no quota
    manager.free("a1")
    assert manager.kv_blocks_of("a") == 0 and manager.quota_shortfall("a", 4) == 0
    assert manager.allocate_slots("a2", 2, tenant="a")


def test_quotas_in_the_qos_config(tmp_path):
    path = tmp_path / "qos.yaml"
    path.write_text("tenants:\n  a: {kv_quota_fraction: 0.25}\n  b: {kv_quota_blocks: 7}\n  c: {weight: 2}\n")
    assert load_qos_config(str(path)).kv_quotas(100) == {"a": 25, "b": 7}
    for body, message in [("a: {kv_quota_fraction: 1.5}", "kv_quota_fraction must be in"),
                          ("a: {kv_quota_blocks: 0}", "kv_quota_blocks must be at least 1"),
                          ("a: {kv_quota_blocks: 3, kv_quota_fraction: 0.5}", "give one")]:
        path.write_text(f"tenants:\n  {body}\n")
        with pytest.raises(ValueError, match=message):
            load_qos_config(str(path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("quota-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


def test_the_engine_holds_a_tenant_to_its_quota_with_unchanged_outputs(folder, tmp_path):
    """Tenant a (quota 6 blocks) sends more than its quota in parallel: its requests take turns
    (one waits, or is preempted and resumes), tenant b's cached prefix survives, and every output is
    that of the request run alone. A request larger than the quota is refused at once."""
    qos = tmp_path / "qos.yaml"
    qos.write_text("tenants:\n  a: {kv_quota_blocks: 6}\n")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[3 + (seed * 13 + 5 * i) % 200 for i in range(14)] for seed in range(4)]
    with LLM(folder, device=TEST_DEVICE, block_size=BLOCK) as alone:
        expected = [alone.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
                    for p in prompts]
    with LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, qos_config=str(qos)) as llm:
        engine = llm.engine
        b_prompt = prompts[3]
        b_id = engine.add_request(None, {"prompt_token_ids": b_prompt}, params, tenant="b")
        ids = [engine.add_request(None, {"prompt_token_ids": p}, params, tenant="a") for p in prompts[:3]]
        outputs, most = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            most = max(most, engine.kv_manager.kv_blocks_of("a"))
        assert most <= 6
        resident, quota = engine.make_stats().scheduler.kv_quotas["a"]
        assert quota == 6 and resident == engine.kv_manager.kv_blocks_of("a") > 0     # its cached prefixes
        assert [outputs[i] for i in ids] == expected[:3] and outputs[b_id] == expected[3]
        namespace = engine.prefix.namespace("b", None)
        probe = _Seq("probe", b_prompt, namespace)
        assert len(engine.kv_manager.find_cached_prefix(probe).block_ids) == len(b_prompt) // BLOCK
        from kvserve.sched.scheduler import RequestRejected
        with pytest.raises(RequestRejected, match="tenant 'a' may hold at most 6"):
            engine.add_request(None, {"prompt_token_ids": list(range(3, 40))}, params, tenant="a")

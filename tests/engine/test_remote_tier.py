"""The remote KV tier (--kv-remote-url): two engines (replicas) on one real redis-server share their
prefix blocks; the second's first request on the first's prefix is a hit with the cold run's tokens.
A damaged value is a miss, another tenant never hits, and a dead server costs misses, not errors."""

from __future__ import annotations

import time

import pytest
from redis_fixture import RedisServers

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import LLM, SamplingParams

BLOCK = 4
PROMPT = [5 + (11 * i) % 190 for i in range(41)]         # 10 full blocks + 1 token
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("remote-tier-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def cold_tokens(folder):
    with LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20) as llm:
        return _tokens(llm, PROMPT)


@pytest.fixture
def redis():
    with RedisServers() as servers:
        yield servers.start()


def _replica(folder: str, url: str, **options) -> LLM:
    return LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, kv_host_memory=1 << 20,
               kv_remote_url=url, async_scheduling="off", **options)


def _tokens(llm: LLM, prompt: list[int], **request) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt, **request}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def _remote_hit_tokens(llm: LLM) -> int:
    return llm.engine.make_stats().kv_cache.cold_hit_tokens.get("remote", 0)


def _remote(llm: LLM):
    (remote,) = llm.engine.make_stats().kv_cache.cold
    return remote


def test_a_second_replica_hits_the_first_ones_prefix(folder, cold_tokens, redis):
    first, second = _replica(folder, redis.url), _replica(folder, redis.url)
    try:
        assert _tokens(first, PROMPT) == cold_tokens
        first.engine.step()                    # hands the last landed blocks down
        first.engine.cold.tiers.flush()
        assert _remote(first).blocks_written >= 10
        assert _tokens(second, PROMPT) == cold_tokens
        assert _remote_hit_tokens(second) == 10 * BLOCK
        assert second.engine.make_stats().kv_cache.host.hit_tokens == 10 * BLOCK
        assert second.engine.make_stats().kv_cache.cold_prefetches["found"] == 1
    finally:
        first.close()
        second.close()


def test_another_tenant_on_the_other_replica_never_hits(folder, cold_tokens, redis):
    with _replica(folder, redis.url) as first:
        first.engine.add_request("a", {"prompt_token_ids": PROMPT}, PARAMS, tenant="tenant-a")
        while first.engine.has_unfinished_requests():
            first.engine.step()
    with _replica(folder, redis.url) as second:
        second.engine.add_request("b", {"prompt_token_ids": PROMPT}, PARAMS, tenant="tenant-b")
        outputs = []
        while second.engine.has_unfinished_requests():
            outputs += second.engine.step()
        assert [o for o in outputs if o.finished][0].outputs[0].token_ids == cold_tokens
        assert _remote_hit_tokens(second) == 0
        second.engine.add_request("a2", {"prompt_token_ids": PROMPT}, PARAMS, tenant="tenant-a")
        while second.engine.has_unfinished_requests():
            second.engine.step()
        assert _remote_hit_tokens(second) == 10 * BLOCK


def test_a_damaged_value_is_a_miss_and_is_removed(folder, cold_tokens, redis):
    with _replica(folder, redis.url) as first:
        _tokens(first, PROMPT)
    client = redis.client()
    keys = sorted(client.keys("kvserve:*:*"))
    victim = next(k for k in keys if not k.startswith(b"kvserve:quota:"))
    value = bytearray(client.get(victim))
    value[len(value) // 3] ^= 0x01
    client.set(victim, bytes(value))
    with _replica(folder, redis.url) as second:
        assert _tokens(second, PROMPT) == cold_tokens
        remote = _remote(second)
        assert remote.corrupt == 1 and _remote_hit_tokens(second) < 10 * BLOCK
    # Removed as a miss, then written again by the replica that recomputed it.
    assert client.get(victim) != bytes(value)


def test_a_dead_server_costs_misses_within_the_wait_and_comes_back(folder, cold_tokens, redis):
    with _replica(folder, redis.url) as first:
        _tokens(first, PROMPT)
    redis.kill()
    with _replica(folder, redis.url, kv_cold_max_wait=1.0) as replica:
        started = time.monotonic()
        assert _tokens(replica, PROMPT) == cold_tokens
        assert time.monotonic() - started < 5.0
        remote = _remote(replica)
        assert not remote.available and remote.errors >= 1 and _remote_hit_tokens(replica) == 0
        outcomes = replica.engine.make_stats().kv_cache.cold_prefetches
        assert outcomes["missed"] >= 1 and outcomes["found"] == 0
        redis.restart()                         # an empty server: the replica writes again by itself
        deadline, shift = time.monotonic() + 15, 0
        while time.monotonic() < deadline:
            shift += 1                          # new blocks to write each time
            _tokens(replica, [(t + shift) % 250 + 1 for t in PROMPT])
            replica.engine.step()
            replica.engine.cold.tiers.flush()
            if _remote(replica).available and _remote(replica).blocks_written > 0:
                break
            time.sleep(0.5)
        assert _remote(replica).available and _remote(replica).blocks_written > 0

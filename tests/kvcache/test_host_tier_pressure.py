"""--kv-host-memory-pressure: the engine's host tier gives its segments back to the OS while PSI
(files in the real /proc/pressure/memory format) reports pressure, and takes them back when calm;
tokens stay those of a cold run throughout, and a swapped-out request's blocks are never released."""

from __future__ import annotations

import pytest

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import LLM, SamplingParams
from kvserve.kvcache.memory_pressure import PressureMonitor

BLOCK = 4
PROMPTS = [[3 + (7 * i + 29 * j) % 200 for i in range(41)] for j in range(6)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _psi(some_avg10: float) -> str:
    return (f"some avg10={some_avg10:.2f} avg60=0.00 avg300=0.00 total=123456\n"
            f"full avg10=0.00 avg60=0.00 avg300=0.00 total=4567\n")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("host-pressure-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


def _tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_pressure_shrinks_the_host_tier_and_calm_grows_it_back(folder, tmp_path):
    probe = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20)
    cold = [_tokens(probe, p) for p in PROMPTS]
    block_bytes = probe.engine.kv_bytes_per_token * BLOCK
    llm = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=block_bytes * 16,
              kv_host_memory=block_bytes * 80, kv_host_memory_pressure=20.0, async_scheduling="off")
    engine = llm.engine
    psi = tmp_path / "proc" / "pressure" / "memory"
    psi.parent.mkdir(parents=True)
    psi.write_text(_psi(0.0))
    engine.host_pressure = PressureMonitor(str(tmp_path), cgroup_dir="", use_meminfo=False, min_interval_s=0.0)
    engine.host_sizer.shrink_cooldown_s = engine.host_sizer.grow_hold_s = 0.0
    store, tier = engine.host_store, engine.kv_manager.host_tier
    full_bytes = store.flat.nbytes
    assert [_tokens(llm, p) for p in PROMPTS] == cold
    assert tier.num_used_blocks > 0 and tier.capacity == 80

    psi.write_text(_psi(55.0))
    for prompt in PROMPTS[:3]:            # every step under pressure gives back one segment (10 blocks)
        assert _tokens(llm, prompt) == cold[PROMPTS.index(prompt)]
    assert tier.capacity < 80 and store.flat.nbytes < full_bytes
    assert store.flat.nbytes == store.flat.num_live_blocks * store.block_nbytes
    assert all(b.host_id < tier.capacity for b in tier._by_hash.values()) and all(h < tier.capacity for h in tier._free)
    stats = engine.make_stats().kv_cache.host
    assert stats.num_blocks == tier.capacity and stats.max_blocks == 80 and stats.blocks_released > 0
    shrunk = tier.capacity
    assert shrunk >= engine.host_sizer.min_blocks

    psi.write_text(_psi(0.0))
    assert [_tokens(llm, p) for p in PROMPTS] == cold
    assert tier.capacity > shrunk and store.flat.num_live_blocks == tier.capacity


def test_a_swapped_out_request_keeps_its_host_blocks_under_pressure():
    from kvserve.kvcache.host_tier import HostTier
    tier = HostTier(40)
    held = tier.reserve(12)                     # a swap: blocks 0..11, outside the index
    chain_hash = [bytes([i]) * 8 for i in range(20)]
    for i, block_hash in enumerate(chain_hash):
        tier.store(block_hash, b"p", (i,), "ns")
    assert tier.set_capacity(5, granule=10) == 20          # cannot go below the swap's blocks (to 12, in 10s)
    assert all(h < 20 for h in held) and tier.num_used_blocks == 8
    tier.release(held)
    tier.end_step()
    assert tier.set_capacity(5, granule=10) == 10
    assert tier.set_capacity(40, granule=10) == 40 and len(tier._free) == 40 - tier.num_used_blocks

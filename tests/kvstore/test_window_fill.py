"""Window formats under prefix caching: a sequence that starts from cached blocks gets its
full-precision ring filled from them (KVCacheStore.fill_window_rows), so the ring holds what the
blocks hold and never another sequence's leftovers."""

from __future__ import annotations

import pytest
import torch

from kvserve.kvstore import KVCacheStore, build_kv_cache_spec


@pytest.mark.parametrize("name,window,sinks", [("int4", 8, 2), ("int8", 16, 3), ("fp8_e4m3", 4, 0)])
def test_fill_window_rows_reads_the_ring_positions_back_from_the_blocks(name, window, sinks):
    spec = build_kv_cache_spec(2, 2, 16, torch.float32, kv_cache_dtype=name, kv_quant_window=window,
                               kv_quant_sinks=sinks, block_size=4)
    store = KVCacheStore.allocate(spec, 12, 4, "cpu", num_rows=3)
    table, num_tokens = [7, 2, 9, 0, 5, 11], 22
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(num_tokens)])
    generator = torch.Generator().manual_seed(0)
    for part in store.quantized_parts():
        part.store(torch.randn(num_tokens, 2, 16, generator=generator), slots)
        part.window.normal_()                      # leftovers of an earlier sequence
    store.fill_window_rows(1, table, num_tokens)
    ring = sinks + window
    for part in store.quantized_parts():
        stored = part.gather_slots(slots)
        for position in range(num_tokens - window, num_tokens):
            assert torch.equal(part.window[ring + sinks + position % window], stored[position])
        for position in range(sinks):
            assert torch.equal(part.window[ring + position], stored[position])


def test_a_prefix_hit_of_a_window_format_gives_the_cold_tokens(tmp_path):
    """int8 with a 16-token window (its error is far below what flips a greedy token of this model):
    prefix caching is on for a window format, the hit is used, and the tokens equal the cold run's,
    which they do not if the ring keeps another sequence's leftovers."""
    from conftest import TEST_DEVICE, build_tiny_checkpoint
    from kvserve import LLM, SamplingParams
    build_tiny_checkpoint("llama", tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [3 + (7 * i) % 200 for i in range(61)]
    other = [9 + (5 * i) % 200 for i in range(61)]
    llm = LLM(str(tmp_path), device=TEST_DEVICE, block_size=4, kv_cache_memory=1 << 20, kv_cache_dtype="int8",
              kv_quant_window=16, kv_quant_sinks=3)
    assert llm.engine.kv_manager.enable_prefix_caching
    run = lambda p: llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids  # noqa: E731
    cold = run(prompt)
    run(other)                       # its ring rows are what a hit would read without the fill
    assert run(prompt) == cold
    assert llm.engine.make_stats().prefix_cache.hit_tokens == 60

"""The random prompts every throughput benchmark sends (`kvserve bench`, the benchmarks/ scripts and
the vLLM baseline): the same token ids for the same seed, whichever system runs them.

Imports nothing from kvserve, so benchmarks/cpu/vllm_cpu_baseline.py can load it by its path in
vLLM's own environment.
"""

from __future__ import annotations


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    import torch
    generator = torch.Generator().manual_seed(seed)
    # Stay clear of the first ids, where special tokens usually live.
    low = min(100, vocab_size // 2)
    return torch.randint(low, vocab_size, (num, input_len), generator=generator).tolist()

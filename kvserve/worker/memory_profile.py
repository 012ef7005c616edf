"""The GPU memory left for the KV cache: free memory after the weights and a profiled worst-case step."""

from __future__ import annotations

import torch

from kvserve.model.interfaces import CausalLM
from kvserve.worker.runner import ModelRunner


def cuda_kv_budget(model: CausalLM, device: torch.device, dtype: torch.dtype, block_size: int,
                   max_num_batched_tokens: int, max_num_seqs: int, attention_backend: str,
                   gpu_memory_utilization: float) -> int:
    """Free memory times gpu_memory_utilization, less the activation peak of one prefill step of
    max_num_batched_tokens (run on a probe runner with a cache of its own)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    probe = ModelRunner(model, device, dtype, -(-max_num_batched_tokens // block_size) + 1, block_size, set(),
                        attention_backend)
    probe.profile_forward(max_num_batched_tokens, min(max_num_seqs, max_num_batched_tokens))
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    del probe
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    budget = int(free * gpu_memory_utilization) - activation_peak
    if budget <= 0:
        raise ValueError("no GPU memory left for the KV cache after weights and activations")
    return budget


def available_host_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of host memory the kernel says can be allocated without swapping (MemAvailable), or
    None where it does not say (not Linux)."""
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# The default host KV tier on CUDA: a quarter of the free host RAM (the rest stays for the process,
# the page cache and other tenants), at most twice the GPU cache (SGLang's HiCache default ratio)
# and 32 GiB (pinning is slow: about a second per few GiB at start).
DEFAULT_HOST_TIER_FRACTION = 0.25
DEFAULT_HOST_TIER_DEVICE_RATIO = 2
DEFAULT_HOST_TIER_MAX_BYTES = 32 << 30
# The host tier's store is allocated in this many segments, the unit memory pressure frees.
HOST_TIER_SEGMENTS = 8


def default_host_tier_bytes(device: torch.device, available: int | None, device_kv_bytes: int) -> int:
    """--kv-host-memory when not given: off on CPU (the KV cache already is host memory)."""
    if device.type != "cuda" or available is None:
        return 0
    return int(min(available * DEFAULT_HOST_TIER_FRACTION, DEFAULT_HOST_TIER_DEVICE_RATIO * device_kv_bytes,
                   DEFAULT_HOST_TIER_MAX_BYTES))

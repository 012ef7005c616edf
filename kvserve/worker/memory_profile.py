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

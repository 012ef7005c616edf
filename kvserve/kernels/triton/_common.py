"""Helpers shared by the kernel launchers: interpreter detection, device facts, small integer maths."""

from __future__ import annotations

import functools

import torch

from kvserve import envs


# Arguments of the split-KV decode kernels that change from step to step. Triton specializes an
# int argument on being 1 or a multiple of 16 and compiles a new variant when that changes: the
# split count (chosen per step from the batch) also sets the partial buffers' strides (e.g. the
# lse row stride is num_heads * num_splits), so without these a batch size reached for the first
# time mid-serving cost a ~0.5 s compile inside a step.
SPLIT_DECODE_DYNAMIC_ARGS = ["num_splits", "block_table_stride_seq", "block_size", "write_final",
                             "partial_stride_seq", "partial_stride_head", "partial_stride_split",
                             "lse_stride_seq", "lse_stride_head"]
SPLIT_COMBINE_DYNAMIC_ARGS = ["num_splits", "partial_stride_seq", "partial_stride_head", "partial_stride_split",
                              "lse_stride_seq", "lse_stride_head"]


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device, cached."""
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch (sm90+). A kernel launched with it is scheduled while the one
    before it drains, then waits (griddepcontrol.wait, its first instruction) until that one has
    finished and its writes are visible: the order of effects is unchanged, the gap between kernels
    shrinks. CUDA graphs keep it. KVSERVE_PDL=0 turns it off."""
    if interpreting() or device.type != "cuda" or not envs.KVSERVE_PDL.is_on():
        return False
    return cuda_capability(device)[0] >= 9


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return envs.TRITON_INTERPRET.is_on()


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small stand-in on CPU (interpreter) so the split
    heuristics still produce several splits there."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def next_power_of_2(value: int) -> int:
    return 1 << max(0, (int(value) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_cache(cache: torch.Tensor, name: str) -> None:
    """The kernels address a token as `slot * stride(1)`, which needs [num_blocks, block_size] to
    merge into one dimension, and read head_dim contiguously."""
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(cache.shape)}")
    if cache.stride(3) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError(f"{name} needs unit head_dim stride and mergeable block/offset dims, "
                         f"got strides {cache.stride()}")

"""Writes a step's new K/V vectors into the paged cache (reference: kvserve.kernels.reference.store_kv).

One program per token moves all of its KV heads (kv_heads * head_dim contiguous elements in the
NHD cache). A slot of -1 marks a padding token (CUDA-graph batches padded to a captured size) and
writes nothing, so the grid depends only on the token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton._common import check_cache, next_power_of_2


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     key_stride_token, key_stride_head, value_stride_token, value_stride_head,
                     cache_stride_slot, cache_stride_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    cache_offsets = slot * cache_stride_slot + heads * cache_stride_head + dims
    key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, kv_heads, head_dim] (any dtype; cast to the cache's) -> cache slots
    `slot_mapping` [T] (int32/int64; -1 = skip). Caches: [num_blocks, block_size, kv_heads, head_dim]."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    check_cache(k_cache, "k_cache")
    check_cache(v_cache, "v_cache")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match the cache "
                         f"({num_kv_heads} kv heads, head_dim {head_dim})")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    # A non-unit head_dim stride (never produced by the model's views) is copied away rather than
    # compiled for.
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_kv_heads), DIM_PAD=next_power_of_2(head_dim),
        # ~8 elements (16 bytes of bf16) per thread.
        num_warps=max(1, min(8, next_power_of_2(num_kv_heads) * next_power_of_2(head_dim) // 256)))

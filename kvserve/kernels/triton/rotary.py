"""Rotary embedding of queries and keys in one kernel, in place on the fused QKV projection output.

Reference: `kvserve.model.layers.apply_rotary` (transformers' half-split rotate_half form). torch runs
it as five elementwise kernels per tensor (mul, neg, cat, mul, add) for q and again for k; at decode
batch sizes each is a few microseconds of launch and latency, ten per layer. This kernel rotates the
query and key heads of a token (HEADS_PER_PROGRAM per program) and writes them back where the GEMM put
them.

`rotary_and_store_kv` also writes the rotated keys and the values into the paged cache (what
kv_store.store_kv would do next), for the attention backends that let the model store K/V.

Rounding follows torch's op order: each product is rounded to the activation dtype before the sum,
so bf16/fp16 results match the reference bit for bit (fp32 up to fused multiply-add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.triton._common import check_cache, next_power_of_2, pdl_enabled


@triton.jit
def _rotary_kernel(qk_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                   token_stride, head_stride, cos_stride, num_heads, num_q_heads,
                   cache_stride_slot, cache_stride_head,
                   HALF: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
                   STORE: tl.constexpr, PDL: tl.constexpr):
    if PDL:     # see _common.pdl_enabled
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    cols = tl.arange(0, HALF_BLOCK)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    base = qk_ptr + token * token_stride + heads[:, None] * head_stride + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    cos_row = cos_ptr + token * cos_stride + cols
    sin_row = sin_ptr + token * cos_stride + cols
    cos1 = tl.load(cos_row, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HALF, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HALF, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    # rotate_half(x) = cat(-x2, x1): first half x1*cos1 - x2*sin1, second half x2*cos2 + x1*sin2.
    out1 = (a * cos1).to(dtype).to(tl.float32) + (-b * sin1).to(dtype).to(tl.float32)
    out2 = (b * cos2).to(dtype).to(tl.float32) + (a * sin2).to(dtype).to(tl.float32)
    tl.store(base, out1.to(dtype), mask=mask)
    tl.store(base + HALF, out2.to(dtype), mask=mask)
    if STORE:
        # The key heads (after the query heads) go to the cache as rotated, and the value heads
        # (after the key heads in the fused QKV row) as they are; a slot of -1 is a padding token.
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            num_kv_heads = num_heads - num_q_heads
            kv_heads = heads - num_q_heads
            is_key = (heads[:, None] >= num_q_heads) & mask
            rows = slot * cache_stride_slot + kv_heads[:, None] * cache_stride_head + cols[None, :]
            rows = tl.where(is_key, rows, 0)
            tl.store(k_cache_ptr + rows, out1.to(k_cache_ptr.dtype.element_ty), mask=is_key)
            tl.store(k_cache_ptr + rows + HALF, out2.to(k_cache_ptr.dtype.element_ty), mask=is_key)
            value_base = base + num_kv_heads * head_stride
            v1 = tl.load(value_base, mask=is_key, other=0.0)
            v2 = tl.load(value_base + HALF, mask=is_key, other=0.0)
            tl.store(v_cache_ptr + rows, v1.to(v_cache_ptr.dtype.element_ty), mask=is_key)
            tl.store(v_cache_ptr + rows + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=is_key)


# Heads per program. A program holding all of a token's heads (a [64, 64] tile for Llama-8B's 40 q+k
# heads) needed 178 registers per thread: 2 programs per SM, and a 16k-token prefill chunk was slow
# for its ~0.4 GB of traffic (measured: docs/gpu_performance.md#decode-throughput-by-batch-size).
# Eight heads per program keep the tile small.
HEADS_PER_PROGRAM = 8


def _num_warps(tile_elements: int) -> int:
    """Warps for a [heads, half] tile without replicas: the kernel rewrites its input in place, and a
    warp that held a copy of elements another warp already rotated and stored would load the
    rotated values and rotate them again (the tiny test models' 6 x 8 tile under 4 warps did)."""
    return max(1, min(4, tile_elements // 128))


def rotary_inplace(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk [T, heads, D] (any token/head strides, D contiguous); cos/sin [T, D] in qk's dtype.

    Rotates every head of every token in place and returns qk. Pass the query and key heads as one
    view when they are adjacent in memory (the fused QKV output): one launch for both.
    """
    return _rotate(qk, cos, sin, None)


def rotary_and_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """The fused QKV output [T, (heads + 2 kv_heads) * D]: rotates q and k in place and writes the
    rotated keys and the values to cache slots `slot_mapping` (-1: skip), one kernel for what
    rotary_inplace + kv_store.store_kv do in two (one launch per layer less).
    Caches [num_blocks, block_size, kv_heads, D], NHD, in any dtype (cast on store)."""
    num_tokens = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not a row-major fused QKV output for {num_heads}/"
                         f"{num_kv_heads} heads of {head_dim}")
    check_cache(k_cache, "k_cache")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or k_cache.stride() != v_cache.stride():
        raise ValueError(f"caches {tuple(k_cache.shape)} do not match {num_kv_heads} kv heads of {head_dim}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
    _rotate(qk, cos, sin, (k_cache, v_cache, slot_mapping, num_heads))


def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store) -> torch.Tensor:
    """store: None, or (k_cache, v_cache, slot_mapping, query heads): the heads after the query heads
    are keys, and the values follow them in qk's rows (the fused QKV layout)."""
    num_tokens, num_heads, head_dim = qk.shape
    if head_dim % 2 or qk.stride(-1) != 1:
        raise ValueError("rotary needs an even head_dim laid out contiguously")
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin must be [{num_tokens}, {head_dim}] and contiguous in the last dim")
    if cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin must share a row stride")
    if num_tokens:
        k_cache, v_cache, slots, num_q_heads = store if store is not None else (qk, qk, cos, num_heads)
        half = head_dim // 2
        heads_block, half_block = min(HEADS_PER_PROGRAM, next_power_of_2(num_heads)), next_power_of_2(half)
        pdl = pdl_enabled(qk.device)
        grid = (num_tokens, -(-num_heads // heads_block))
        _rotary_kernel[grid](qk, cos, sin, k_cache, v_cache, slots, qk.stride(0), qk.stride(1), cos.stride(0),
                             num_heads, num_q_heads, k_cache.stride(1) if store else 0,
                             k_cache.stride(2) if store else 0, HALF=half, HEADS_BLOCK=heads_block,
                             HALF_BLOCK=half_block, STORE=store is not None, PDL=pdl,
                             num_warps=_num_warps(heads_block * half_block), launch_pdl=pdl)
    return qk

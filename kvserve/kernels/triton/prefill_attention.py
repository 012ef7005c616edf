"""Varlen paged prefill attention: every prefill chunk of a step in one launch.

Reference: `kvserve.kernels.reference.paged_prefill_attention` for one chunk (and
`reference.prefill_attention` for a chunk without a cached prefix, which is the same computation
once the chunk's own K/V are in the cache).

A chunk is Q query tokens that are the last Q of a C-token context already in the cache (the step's
store_kv has written the chunk's own K/V); query i sees context positions <= C - Q + i. Contexts are
addressed through a flat list of slots per chunk (the metadata the runner already builds), so a
plain prefill is just a chunk whose slots are its own slot_mapping span.

Design:
- Grid (query tiles, chunks, kv_heads). A tile packs BLOCK_M rows as (query, head-of-the-GQA-group)
  pairs, head fastest: K/V tiles are loaded once per KV head and serve the whole group, and a short
  chunk still fills the tensor-core M dimension. Tiles run last-first (the longest causal rows
  start first).
- Key tiles of BLOCK_N positions: those every row of the tile may see run without a mask; the
  diagonal tiles apply the causal mask. fp32 online softmax in exp2 units.
- Host data (chunk count, longest chunk) sizes the grid: prefill steps are not graph-captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton._common import cdiv, check_cache, interpreting, next_power_of_2

LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128        # rows (query, group head) per program
    block_n: int = 64         # context positions per loop iteration
    num_warps: int = 8
    num_stages: int = 2


def default_prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    if interpreting():
        return PrefillConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        # fp32 dots run on FMA units ("ieee"): small tiles, more warps, to limit register spills.
        return PrefillConfig(block_m=32, block_n=32, num_warps=8, num_stages=1)
    if head_dim <= 64:
        return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=2)
    return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


@dataclass
class PrefillPlan:
    """Device-side description of a step's prefill chunks (built once per step, reused by every layer)."""
    chunk_info: torch.Tensor      # [4, num_chunks] int32: query_start, query_len, context_len, slot_start
    context_slots: torch.Tensor   # [sum of context_len] int64: each chunk's context slots, in order
    num_chunks: int
    max_query_len: int


def plan_prefill(chunks: Sequence, slot_mapping: torch.Tensor) -> PrefillPlan:
    """chunks: objects with query_start, query_len, context_len, context_slots (PrefillChunk).
    A chunk without context_slots is a whole prompt: its context is its own slot_mapping span."""
    starts, lens, contexts, slot_starts, slot_parts = [], [], [], [], []
    total_slots = 0
    for chunk in chunks:
        slots = chunk.context_slots
        if slots is None:
            if chunk.context_len != chunk.query_len:
                raise ValueError("a chunk without context_slots must be its whole context")
            slots = slot_mapping[chunk.query_start:chunk.query_start + chunk.query_len]
        if slots.shape[0] != chunk.context_len or chunk.query_len > chunk.context_len:
            raise ValueError(f"chunk at {chunk.query_start}: {chunk.query_len} queries, context_len "
                             f"{chunk.context_len}, {slots.shape[0]} context slots")
        starts.append(chunk.query_start)
        lens.append(chunk.query_len)
        contexts.append(chunk.context_len)
        slot_starts.append(total_slots)
        slot_parts.append(slots.to(torch.int64))
        total_slots += chunk.context_len
    device = slot_mapping.device
    info = torch.tensor([starts, lens, contexts, slot_starts], dtype=torch.int32)
    info = info.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else info.to(device)
    context_slots = (torch.cat(slot_parts) if slot_parts
                     else torch.empty(0, dtype=torch.int64, device=device))
    return PrefillPlan(info, context_slots, len(starts), max(lens, default=0))


@triton.jit
def _attend_tile(query, acc, running_max, running_sum, key_start, slot_base, k_cache_ptr, v_cache_ptr,
                 head_offset, cache_stride_slot, query_pos, key_end, scale_log2, dims, dim_mask,
                 BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                 DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, VALUE_DTYPE: tl.constexpr):
    keys_pos = key_start + tl.arange(0, BLOCK_N)
    if CAUSAL_MASK:
        key_valid = keys_pos < key_end
        slots = tl.load(slot_base + keys_pos, mask=key_valid, other=0)
        kv_mask = key_valid[:, None] & dim_mask[None, :]
    else:
        slots = tl.load(slot_base + keys_pos)
        kv_mask = dim_mask[None, :]
    rows = slots.to(tl.int64) * cache_stride_slot + head_offset
    keys = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    values = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if DOT_UPCAST:
        scores = tl.dot(query, tl.trans(keys.to(tl.float32)))
    else:
        scores = tl.dot(query, tl.trans(keys.to(query.dtype)), input_precision=DOT_PRECISION)
    scores = scores * scale_log2
    if CAUSAL_MASK:
        visible = (keys_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    rescale = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    probs = probs.to(VALUE_DTYPE)
    if DOT_UPCAST:
        update = tl.dot(probs.to(tl.float32), values.to(tl.float32))
    else:
        update = tl.dot(probs, values.to(VALUE_DTYPE), input_precision=DOT_PRECISION)
    acc = acc * rescale[:, None] + update
    return acc, new_max, running_sum


# The tile and chunk counts change every step: not specialised on, so one compiled kernel per shape.
@triton.jit(do_not_specialize=["num_query_tiles", "num_chunks"])
def _prefill_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, out_ptr, chunk_info_ptr, context_slots_ptr,
        scale_log2, num_query_tiles, num_chunks,
        query_stride_token, query_stride_head, out_stride_token, out_stride_head,
        cache_stride_slot, cache_stride_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    QUERIES_PER_TILE: tl.constexpr = BLOCK_M // GROUP_PAD
    tile = num_query_tiles - 1 - tl.program_id(0)
    chunk = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(chunk_info_ptr + chunk)
    query_len = tl.load(chunk_info_ptr + num_chunks + chunk)
    context_len = tl.load(chunk_info_ptr + 2 * num_chunks + chunk)
    slot_start = tl.load(chunk_info_ptr + 3 * num_chunks + chunk)
    first_query = tile * QUERIES_PER_TILE
    if first_query >= query_len:
        return

    rows = tl.arange(0, BLOCK_M)
    query_index = first_query + rows // GROUP_PAD
    group_index = rows % GROUP_PAD
    row_valid = (query_index < query_len) & (group_index < GROUP)
    heads = kv_head * GROUP + group_index
    tokens = (query_start + query_index).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    io_mask = row_valid[:, None] & dim_mask[None, :]
    query = tl.load(query_ptr + tokens[:, None] * query_stride_token + heads[:, None] * query_stride_head
                    + dims[None, :], mask=io_mask, other=0.0)
    if DOT_UPCAST:
        query = query.to(tl.float32)

    prefix_len = context_len - query_len
    query_pos = prefix_len + query_index                 # padding rows: past the chunk, harmless
    last_query = tl.minimum(first_query + QUERIES_PER_TILE, query_len) - 1
    # Positions every row of the tile sees, in whole tiles; then the diagonal, masked.
    unmasked_end = ((prefix_len + first_query + 1) // BLOCK_N) * BLOCK_N
    causal_end = prefix_len + last_query + 1

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    slot_base = context_slots_ptr + slot_start.to(tl.int64)
    head_offset = kv_head * cache_stride_head
    value_dtype: tl.constexpr = query_ptr.dtype.element_ty
    for key_start in range(0, unmasked_end, BLOCK_N):
        acc, running_max, running_sum = _attend_tile(
            query, acc, running_max, running_sum, key_start, slot_base, k_cache_ptr, v_cache_ptr,
            head_offset, cache_stride_slot, query_pos, causal_end, scale_log2, dims, dim_mask,
            BLOCK_N, False, DOT_UPCAST, DOT_PRECISION, value_dtype)
    for key_start in range(unmasked_end, causal_end, BLOCK_N):
        acc, running_max, running_sum = _attend_tile(
            query, acc, running_max, running_sum, key_start, slot_base, k_cache_ptr, v_cache_ptr,
            head_offset, cache_stride_slot, query_pos, causal_end, scale_log2, dims, dim_mask,
            BLOCK_N, True, DOT_UPCAST, DOT_PRECISION, value_dtype)

    # Every row sees position 0, so running_sum > 0.
    result = acc / running_sum[:, None]
    tl.store(out_ptr + tokens[:, None] * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
             result.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            plan: PrefillPlan, scale: float, *, out: torch.Tensor | None = None,
                            config: PrefillConfig | None = None) -> torch.Tensor:
    """query [T, heads, D] (the step's flat batch; chunks index it by query_start); caches
    [num_blocks, block_size, kv_heads, D], already holding every chunk's context. Writes the rows
    of the plan's chunks into `out` (default: a new uninitialised [T, heads, D]) and returns it."""
    num_heads, head_dim = query.shape[1:]
    check_cache(k_cache, "k_cache")
    check_cache(v_cache, "v_cache")
    num_kv_heads = k_cache.shape[2]
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit query {tuple(query.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if out is None:
        out = torch.empty_like(query)
    if plan.num_chunks == 0 or plan.max_query_len == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if out.stride(2) != 1:
        raise ValueError("out needs a unit head_dim stride")
    config = config or default_prefill_config(head_dim, query.dtype)
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_m = max(config.block_m, group_pad, 16)
    queries_per_tile = block_m // group_pad
    num_query_tiles = cdiv(plan.max_query_len, queries_per_tile)
    _prefill_kernel[(num_query_tiles, plan.num_chunks, num_kv_heads)](
        query, k_cache, v_cache, out, plan.chunk_info, plan.context_slots,
        float(scale) * LOG2_E, num_query_tiles, plan.num_chunks,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=max(16, config.block_n),
        DOT_UPCAST=interpreting(), DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out

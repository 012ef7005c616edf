"""Varlen paged prefill attention over quantized KV caches: every chunk with a cached context in one launch.

Reference: `kvserve.kernels.quant_reference.paged_prefill_attention` for one chunk (gather the
context's codes and scales, dequantize, put the full-precision window's copies in place, SDPA).

The grid, tiles and causal split are those of prefill_attention.py (query tiles of (query, GQA head)
rows, K/V tiles loaded once per KV head, unmasked tiles then the diagonal). What differs is the K/V
load: each tile comes through decode_attention_quant's `_load_part`, which reads a part's codes and
scales (or a plain part's values), dequantizes them in registers and overlays the ring's exact
copies of the sink positions and of the context's last `window` positions. A prefill tile is
[BLOCK_M, BLOCK_N] of dot work per [BLOCK_N, head_dim] tile loaded, so the element-wise dequant,
which bounds the generic decode kernel, is spread over BLOCK_M rows here.

Before this kernel those chunks went through the torch reference on the GPU: per chunk and layer, a
gather of the whole context, its dequantization into a new tensor, and SDPA with a materialized mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton._common import cdiv, interpreting, next_power_of_2
from kvserve.kernels.triton.decode_attention_quant import _load_part, _part_args
from kvserve.kernels.triton.prefill_attention import LOG2_E, PrefillPlan, default_prefill_config, plan_prefill


@triton.jit
def _attend_quant_tile(query, acc, running_max, running_sum, key_start, slot_base, key_end, query_pos,
                       k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, k_static_ptr, v_static_ptr, k_ring_ptr, v_ring_ptr,
                       kv_head, seq_row, context_len, dims, dim_mask, scale_log2,
                       k_stride_slot, k_stride_head, v_stride_slot, v_stride_head,
                       ks_stride_slot, ks_stride_head, vs_stride_slot, vs_stride_head,
                       ring_stride_token, ring_stride_head,
                       K_FORMAT: tl.constexpr, V_FORMAT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
                       K_STATIC: tl.constexpr, V_STATIC: tl.constexpr, K_SINKS: tl.constexpr,
                       K_WINDOW: tl.constexpr, V_SINKS: tl.constexpr, V_WINDOW: tl.constexpr,
                       HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL_MASK: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       VALUE_DTYPE: tl.constexpr):
    keys_pos = key_start + tl.arange(0, BLOCK_N)
    key_valid = keys_pos < key_end
    # Slots address a token directly ([num_blocks, block_size] merged): `_load_part` gets them as
    # its block ids, with offset 0 and the per-token strides as block strides.
    slots = tl.load(slot_base + keys_pos, mask=key_valid, other=0).to(tl.int64)
    zero = tl.zeros([BLOCK_N], tl.int64)
    keys = _load_part(k_ptr, k_scales_ptr, k_static_ptr, k_ring_ptr, slots, zero, keys_pos, key_valid, dims,
                      dim_mask, kv_head, seq_row, context_len, k_stride_slot, 0, k_stride_head,
                      ks_stride_slot, 0, ks_stride_head, ring_stride_token, ring_stride_head,
                      K_FORMAT, K_GROUP, K_STATIC, HEAD_DIM, K_SINKS, K_WINDOW, query.dtype, BLOCK_N, DIM_PAD)
    values = _load_part(v_ptr, v_scales_ptr, v_static_ptr, v_ring_ptr, slots, zero, keys_pos, key_valid, dims,
                        dim_mask, kv_head, seq_row, context_len, v_stride_slot, 0, v_stride_head,
                        vs_stride_slot, 0, vs_stride_head, ring_stride_token, ring_stride_head,
                        V_FORMAT, V_GROUP, V_STATIC, HEAD_DIM, V_SINKS, V_WINDOW, VALUE_DTYPE, BLOCK_N, DIM_PAD)
    if DOT_UPCAST:
        scores = tl.dot(query, tl.trans(keys.to(tl.float32)))
    else:
        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION)
    scores = scores * scale_log2
    if CAUSAL_MASK:
        visible = (keys_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    rescale = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    if DOT_UPCAST:
        update = tl.dot(probs, values.to(tl.float32))
    else:
        update = tl.dot(probs.to(VALUE_DTYPE), values, input_precision=DOT_PRECISION)
    acc = acc * rescale[:, None] + update
    return acc, new_max, running_sum


@triton.jit(do_not_specialize=["num_query_tiles", "num_chunks"])
def _prefill_quant_kernel(
        query_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, k_static_ptr, v_static_ptr, k_ring_ptr, v_ring_ptr,
        out_ptr, chunk_info_ptr, context_slots_ptr, chunk_rows_ptr,
        scale_log2, num_query_tiles, num_chunks,
        query_stride_token, query_stride_head, out_stride_token, out_stride_head,
        k_stride_slot, k_stride_head, v_stride_slot, v_stride_head,
        ks_stride_slot, ks_stride_head, vs_stride_slot, vs_stride_head,
        ring_stride_token, ring_stride_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        K_FORMAT: tl.constexpr, V_FORMAT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
        K_STATIC: tl.constexpr, V_STATIC: tl.constexpr, K_RING: tl.constexpr, V_RING: tl.constexpr,
        SINKS: tl.constexpr, WINDOW: tl.constexpr):
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
    seq_row = 0
    if K_RING or V_RING:
        seq_row = tl.load(chunk_rows_ptr + chunk).to(tl.int64)

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
    query_pos = prefix_len + query_index
    last_query = tl.minimum(first_query + QUERIES_PER_TILE, query_len) - 1
    unmasked_end = ((prefix_len + first_query + 1) // BLOCK_N) * BLOCK_N
    causal_end = prefix_len + last_query + 1

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    slot_base = context_slots_ptr + slot_start.to(tl.int64)
    value_dtype: tl.constexpr = query_ptr.dtype.element_ty
    for key_start in range(0, unmasked_end, BLOCK_N):
        acc, running_max, running_sum = _attend_quant_tile(
            query, acc, running_max, running_sum, key_start, slot_base, causal_end, query_pos,
            k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, k_static_ptr, v_static_ptr, k_ring_ptr, v_ring_ptr,
            kv_head, seq_row, context_len, dims, dim_mask, scale_log2,
            k_stride_slot, k_stride_head, v_stride_slot, v_stride_head,
            ks_stride_slot, ks_stride_head, vs_stride_slot, vs_stride_head, ring_stride_token, ring_stride_head,
            K_FORMAT, V_FORMAT, K_GROUP, V_GROUP, K_STATIC, V_STATIC,
            SINKS if K_RING else 0, WINDOW if K_RING else 0, SINKS if V_RING else 0, WINDOW if V_RING else 0,
            HEAD_DIM, DIM_PAD, BLOCK_N, False, DOT_UPCAST, DOT_PRECISION, value_dtype)
    for key_start in range(unmasked_end, causal_end, BLOCK_N):
        acc, running_max, running_sum = _attend_quant_tile(
            query, acc, running_max, running_sum, key_start, slot_base, causal_end, query_pos,
            k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, k_static_ptr, v_static_ptr, k_ring_ptr, v_ring_ptr,
            kv_head, seq_row, context_len, dims, dim_mask, scale_log2,
            k_stride_slot, k_stride_head, v_stride_slot, v_stride_head,
            ks_stride_slot, ks_stride_head, vs_stride_slot, vs_stride_head, ring_stride_token, ring_stride_head,
            K_FORMAT, V_FORMAT, K_GROUP, V_GROUP, K_STATIC, V_STATIC,
            SINKS if K_RING else 0, WINDOW if K_RING else 0, SINKS if V_RING else 0, WINDOW if V_RING else 0,
            HEAD_DIM, DIM_PAD, BLOCK_N, True, DOT_UPCAST, DOT_PRECISION, value_dtype)

    # Every row sees position 0, so running_sum > 0.
    result = acc / running_sum[:, None]
    tl.store(out_ptr + tokens[:, None] * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
             result.to(out_ptr.dtype.element_ty), mask=io_mask)


def _mergeable(tensor: torch.Tensor) -> bool:
    """[num_blocks, block_size, ...] addressable by one per-token stride, innermost dim contiguous."""
    return tensor.stride(-1) == 1 and tensor.stride(0) == tensor.shape[1] * tensor.stride(1)


def prefill_quant_supported(query: torch.Tensor, k_cache, v_cache) -> bool:
    """Whether the kernel covers this layer's parts: every tensor addressable per token, and where a
    part keeps a full-precision ring, every quantized part keeps one of the same shape (as the
    decode kernels require)."""
    if query.device.type != "cuda" and not interpreting():
        return False
    parts = [k_cache, v_cache]
    for part in parts:
        tensors = [part] if isinstance(part, torch.Tensor) else [part.payload] + (
            [part.scales] if part.scales is not None else [])
        if not all(_mergeable(t) for t in tensors):
            return False
    quantized = [p for p in parts if not isinstance(p, torch.Tensor)]
    rings = [p for p in quantized if p.window is not None]
    if rings and (len(rings) != len(quantized)
                  or len({(p.num_sinks, p.window_size, p.window.stride()[:2]) for p in rings}) != 1
                  or any(p.window.stride(2) != 1 for p in rings)):
        return False
    return True


@dataclass
class QuantPrefillPlan:
    """A step's chunks with a cached context (built once per step, reused by every layer)."""
    plan: PrefillPlan
    chunk_rows: torch.Tensor      # [num_chunks] int64: each chunk's row in the window rings (-1: none)
    all_rows: bool                # every chunk has a row (needed where a part keeps a ring)


def plan_quant_prefill(chunks: Sequence, slot_mapping: torch.Tensor) -> QuantPrefillPlan:
    """chunks: PrefillChunk (query_start, query_len, context_len, context_slots, kv_row)."""
    rows = [chunk.kv_row for chunk in chunks]
    return QuantPrefillPlan(plan_prefill(chunks, slot_mapping),
                            torch.tensor(rows, dtype=torch.int64).to(slot_mapping.device, non_blocking=True),
                            all(row >= 0 for row in rows))


def paged_prefill_attention_quant(query: torch.Tensor, k_cache, v_cache, quant_plan: QuantPrefillPlan,
                                  scale: float, *, out: torch.Tensor) -> torch.Tensor:
    """The rows of the plan's chunks, each over its cached context in k_cache / v_cache
    (QuantizedKVCache or plain parts, already holding the chunk's own K/V), written into `out`
    [T, heads, D] (the step's flat batch; chunks index it by query_start)."""
    plan = quant_plan.plan
    if plan.num_chunks == 0 or plan.max_query_len == 0:
        return out
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if out.stride(2) != 1:
        raise ValueError("out needs a unit head_dim stride")
    if query.stride(2) != 1:
        query = query.contiguous()
    rings = [p for p in (k_cache, v_cache) if not isinstance(p, torch.Tensor) and p.window is not None]
    if rings and not quant_plan.all_rows:
        raise ValueError("a part keeps a full-precision window: every chunk needs its kv_row")
    k_args, v_args = _part_args(k_cache, query), _part_args(v_cache, query)
    sinks, window = (rings[0].num_sinks, rings[0].window_size) if rings else (0, 0)
    ring_strides = rings[0].window.stride()[:2] if rings else (0, 0)
    config = default_prefill_config(head_dim, query.dtype)
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_m = max(config.block_m, group_pad, 16)
    num_query_tiles = cdiv(plan.max_query_len, block_m // group_pad)
    interpret = interpreting()
    _prefill_quant_kernel[(num_query_tiles, plan.num_chunks, num_kv_heads)](
        query, k_args[0], v_args[0], k_args[1], v_args[1], k_args[2], v_args[2], k_args[3], v_args[3],
        out, plan.chunk_info, plan.context_slots, quant_plan.chunk_rows,
        float(scale) * LOG2_E, num_query_tiles, plan.num_chunks,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_args[4][1], k_args[4][2], v_args[4][1], v_args[4][2],
        k_args[5][1], k_args[5][2], v_args[5][1], v_args[5][2], *ring_strides,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=max(16, config.block_n), DOT_UPCAST=interpret,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        K_FORMAT=k_args[6], V_FORMAT=v_args[6], K_GROUP=k_args[7], V_GROUP=v_args[7],
        K_STATIC=k_args[8], V_STATIC=v_args[8], K_RING=k_args[9], V_RING=v_args[9], SINKS=sinks, WINDOW=window,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out

"""MLA decode over the paged latent cache (absorbed form), and the latent cache's store.

Reference: `kvserve.kernels.mla_reference.mla_decode_attention` / `store_latent`.

Design:
- The cache of a layer is a latent part [blocks, block_size, 1, r] and a RoPE-key part
  [blocks, block_size, 1, dr] (kvserve/model/mla_cache.py). Every query head attends to the same
  latent, so this is MQA with a (r + dr)-wide key whose first r channels are also the value.
- Grid (batch, head blocks, splits). A program owns BLOCK_H query heads of one sequence and one
  slice of its context: it loads each [TILE, r] latent tile and [TILE, dr] RoPE tile once and
  serves all its heads with two tensor-core dots for the scores (q_latent . c + q_rope . k_rope)
  and one for P @ c. With 16 heads (V2-Lite) one head block covers the layer, so the latent is read
  from HBM once per sequence; with 128 heads (V3) four blocks read it four times (from L2 mostly).
- Online softmax in fp32 with exp2 (scale folded into log2 units); the probabilities enter P @ c in
  the query dtype, as in the reference.
- Split-KV as decode_attention.py: the same split-length rule, split heuristic and combine kernel
  (the latent-space output [B, H, r] is combined like a head_dim-r output), so the launch is
  CUDA-graph safe (grid from host values fixed at capture, lengths and tables read on the device;
  context length 0 gives zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton._common import SPLIT_DECODE_DYNAMIC_ARGS, check_cache, interpreting, next_power_of_2
from kvserve.kernels.triton.decode_attention import (COMBINE_SPLIT_CHUNK, LOG2_E, DecodeConfig,
                                                     _decode_combine_kernel, _split_length, choose_num_splits,
                                                     unused_partials)


def default_mla_config(rank: int, dtype: torch.dtype) -> DecodeConfig:
    if interpreting():
        return DecodeConfig(tile=16, num_warps=1, num_stages=1, min_split_tokens=32)
    if dtype == torch.float32:
        return DecodeConfig(tile=16, num_warps=4, num_stages=1)
    # A [32, 512] bf16 latent tile is 32 KB: two stages in flight fit shared memory comfortably.
    return DecodeConfig(tile=32, num_warps=8 if rank >= 256 else 4, num_stages=2)


def head_block(num_heads: int) -> int:
    """Query heads per program: >= 16 rows for tl.dot; 32 at most, so the [heads, r] fp32
    accumulator of r = 512 stays in registers."""
    return 16 if num_heads <= 16 else 32


@triton.jit
def _store_rows_kernel(x_ptr, cache_ptr, slot_ptr, x_stride_token, cache_stride_slot,
                       DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:                       # CUDA-graph padding row
        return
    dims = tl.arange(0, DIM_PAD)
    mask = dims < DIM
    values = tl.load(x_ptr + token * x_stride_token + dims, mask=mask)
    tl.store(cache_ptr + slot * cache_stride_slot + dims, values.to(cache_ptr.dtype.element_ty), mask=mask)


def store_rows(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """x [T, 1, D] -> cache [blocks, block_size, 1, D] at `slot_mapping` [T] (-1 = skip)."""
    check_cache(cache, "cache")
    num_tokens, dim = x.shape[0], cache.shape[3]
    if x.shape[1:] != (1, dim):
        raise ValueError(f"rows {tuple(x.shape)} do not fit cache {tuple(cache.shape)}")
    if num_tokens == 0:
        return
    if x.stride(2) != 1:
        x = x.contiguous()
    _store_rows_kernel[(num_tokens,)](x, cache, slot_mapping, x.stride(0), cache.stride(1),
                                      DIM=dim, DIM_PAD=next_power_of_2(dim), num_warps=4 if dim >= 256 else 1)


def store_latent(latent: torch.Tensor, k_rope: torch.Tensor, latent_cache: torch.Tensor,
                 rope_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    store_rows(latent, latent_cache, slot_mapping)
    store_rows(k_rope, rope_cache, slot_mapping)


@triton.jit(do_not_specialize=SPLIT_DECODE_DYNAMIC_ARGS)
def _mla_split_kernel(
        q_latent_ptr, q_rope_ptr, latent_ptr, rope_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, partial_out_ptr, partial_lse_ptr,
        scale_log2, num_splits, block_size, write_final,
        q_latent_stride_seq, q_latent_stride_head, q_rope_stride_seq, q_rope_stride_head,
        out_stride_seq, out_stride_head, block_table_stride_seq,
        latent_stride_block, latent_stride_token, rope_stride_block, rope_stride_token,
        partial_stride_seq, partial_stride_head, partial_stride_split, lse_stride_seq, lse_stride_head,
        NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
        RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
        TILE: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr,
        DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    split_len = _split_length(context_len, num_splits, TILE, MIN_SPLIT_TOKENS)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)
    if write_final == 0:
        if start >= context_len:
            return

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < NUM_HEADS
    ranks = tl.arange(0, RANK_PAD)
    rank_mask = ranks < RANK
    ropes = tl.arange(0, ROPE_PAD)
    rope_mask = ropes < ROPE
    q_latent = tl.load(q_latent_ptr + seq * q_latent_stride_seq + heads[:, None] * q_latent_stride_head
                       + ranks[None, :], mask=head_mask[:, None] & rank_mask[None, :], other=0.0)
    q_rope = tl.load(q_rope_ptr + seq * q_rope_stride_seq + heads[:, None] * q_rope_stride_head + ropes[None, :],
                     mask=head_mask[:, None] & rope_mask[None, :], other=0.0)
    if DOT_UPCAST:
        q_latent = q_latent.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    value_dtype: tl.constexpr = q_latent_ptr.dtype.element_ty

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    table_row = block_tables_ptr + seq * block_table_stride_seq
    for tile_start in range(start, end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < end
        blocks = tl.load(table_row + positions // block_size, mask=valid, other=0).to(tl.int64)
        offsets = (positions % block_size).to(tl.int64)
        latent = tl.load(latent_ptr + (blocks * latent_stride_block + offsets * latent_stride_token)[:, None]
                         + ranks[None, :], mask=valid[:, None] & rank_mask[None, :], other=0.0).to(q_latent.dtype)
        rope = tl.load(rope_ptr + (blocks * rope_stride_block + offsets * rope_stride_token)[:, None] + ropes[None, :],
                       mask=valid[:, None] & rope_mask[None, :], other=0.0).to(q_rope.dtype)
        scores = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(rope), input_precision=DOT_PRECISION)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        probs = probs.to(value_dtype)
        if DOT_UPCAST:
            update = tl.dot(probs.to(tl.float32), latent.to(tl.float32))
        else:
            update = tl.dot(probs, latent.to(value_dtype), input_precision=DOT_PRECISION)
        acc = acc * rescale[:, None] + update
        running_max = new_max

    safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
    result = acc / safe_sum[:, None]
    out_mask = head_mask[:, None] & rank_mask[None, :]
    if write_final != 0:
        tl.store(out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + ranks[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(partial_out_ptr + seq * partial_stride_seq + heads[:, None] * partial_stride_head
                 + split * partial_stride_split + ranks[None, :], result, mask=out_mask)
        tl.store(partial_lse_ptr + seq * lse_stride_seq + heads * lse_stride_head + split,
                 running_max + tl.log2(safe_sum), mask=head_mask)


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                         rope_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float, *, out: torch.Tensor | None = None, max_context_len: int | None = None,
                         num_splits: int | None = None, config: DecodeConfig | None = None) -> torch.Tensor:
    """q_latent [B, H, r], q_rope [B, H, dr] (any strides with a unit last one); caches as above;
    block_tables [B, max_blocks] int32/int64; context_lens [B] (0 = padding row -> zeros).
    Returns the latent-space output [B, H, r] in the query dtype. No host synchronisation."""
    batch, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[2]
    check_cache(latent_cache, "latent_cache")
    check_cache(rope_cache, "rope_cache")
    _, block_size, _, cache_rank = latent_cache.shape
    if cache_rank != rank or rope_cache.shape[3] != rope_dim or latent_cache.shape[2] != 1:
        raise ValueError(f"queries r={rank}, dr={rope_dim} vs caches {tuple(latent_cache.shape)}/"
                         f"{tuple(rope_cache.shape)}")
    if out is None:
        out = q_latent.new_empty(batch, num_heads, rank)
    if batch == 0:
        return out
    if q_latent.stride(2) != 1:
        q_latent = q_latent.contiguous()
    if q_rope.stride(2) != 1:
        q_rope = q_rope.contiguous()
    config = config or default_mla_config(rank, q_latent.dtype)
    block_h = head_block(num_heads)
    num_head_blocks = -(-num_heads // block_h)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_head_blocks, max_context_len, q_latent.device, config)
    rank_pad, rope_pad = max(16, next_power_of_2(rank)), max(16, next_power_of_2(rope_dim))
    meta = dict(NUM_HEADS=num_heads, BLOCK_H=block_h, RANK=rank, RANK_PAD=rank_pad, ROPE=rope_dim, ROPE_PAD=rope_pad,
                TILE=config.tile, MIN_SPLIT_TOKENS=config.min_split_tokens, DOT_UPCAST=interpreting(),
                DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
                num_warps=config.num_warps, num_stages=config.num_stages)
    common = (q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
              out.stride(0), out.stride(1), block_tables.stride(0),
              latent_cache.stride(0), latent_cache.stride(1), rope_cache.stride(0), rope_cache.stride(1))
    scale_log2 = float(scale) * LOG2_E
    if num_splits == 1:
        _mla_split_kernel[(batch, num_head_blocks, 1)](
            q_latent, q_rope, latent_cache, rope_cache, block_tables, context_lens, out, unused_partials(out),
            unused_partials(out),
            scale_log2, 1, block_size, 1, *common, 0, 0, 0, 0, 0, **meta)
        return out
    partial_out = torch.empty(batch, num_heads, num_splits, rank, dtype=torch.float32, device=q_latent.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q_latent.device)
    _mla_split_kernel[(batch, num_head_blocks, num_splits)](
        q_latent, q_rope, latent_cache, rope_cache, block_tables, context_lens, out, partial_out, partial_lse,
        scale_log2, num_splits, block_size, 0, *common,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), **meta)
    _decode_combine_kernel[(batch, num_heads)](
        partial_out, partial_lse, context_lens, out, num_splits,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=rank, DIM_PAD=rank_pad, TILE=config.tile, MIN_SPLIT_TOKENS=config.min_split_tokens,
        SPLIT_CHUNK=COMBINE_SPLIT_CHUNK, num_warps=4)
    return out

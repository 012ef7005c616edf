"""Paged decode attention that reads a quantized KV cache directly (fused dequantization).

Reference: `kvserve.kernels.quant_reference.paged_decode_attention`. Same design as
decode_attention.py (grid batch x kv_heads x splits, GQA group served from one K/V tile load,
online softmax in fp32, split-KV with the same combine kernel and split heuristic), with each part
(K, V) read in its own format:
- plain: the model-dtype cache, as in decode_attention.py;
- int8 / fp8-e4m3: one byte per element, times the token's fp16 group scale (or the static
  per-channel scale) in fp32, then cast to the query dtype for the tensor-core dot;
- int4: byte `d % (head_dim/2)` of the token's row, shifted by 4 for the upper half of the head.
Where a quantized part keeps a full-precision window (sinks + most recent tokens of each sequence,
kvserve.kvcache.quant), positions inside it are read from the ring instead. The bytes a step reads
shrink with the format, which is what makes long-context decode faster: the kernel is bandwidth bound.
CUDA-graph safe like decode_attention.py: context lengths, block tables and sequence rows are read
on the device only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton._common import interpreting, next_power_of_2
from kvserve.kernels.triton.decode_attention import (LOG2_E, DecodeConfig, _decode_combine_kernel, _split_length,
                                                     choose_num_splits, decode_workspace, default_decode_config)
from kvserve.kernels.triton.kv_store_quant import FORMAT_CODES


@triton.jit
def _tile_scales(scales_ptr, scale_rows, valid, TILE: tl.constexpr, NUM_GROUPS: tl.constexpr,
                 GROUP: tl.constexpr):
    """The [TILE, NUM_GROUPS * GROUP] per-element scales of a tile, from one load of its
    [TILE, NUM_GROUPS] fp16 group scales (not one gather per element)."""
    if NUM_GROUPS == 1:
        scale = tl.load(scales_ptr + scale_rows, mask=valid, other=0.0).to(tl.float32)
        return tl.broadcast_to(scale[:, None], (TILE, GROUP))
    groups = tl.arange(0, NUM_GROUPS)
    scale = tl.load(scales_ptr + scale_rows[:, None] + groups[None, :], mask=valid[:, None], other=0.0)
    return tl.reshape(tl.broadcast_to(scale.to(tl.float32)[:, :, None], (TILE, NUM_GROUPS, GROUP)),
                      (TILE, NUM_GROUPS * GROUP))


@triton.jit
def _load_part(ptr, scales_ptr, static_ptr, ring_ptr, blocks, offsets, positions, valid, dims, dim_mask,
               kv_head, seq_row, context_len,
               stride_block, stride_token, stride_head,
               scales_stride_block, scales_stride_token, scales_stride_head,
               ring_stride_token, ring_stride_head,
               FORMAT: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr, HEAD_DIM: tl.constexpr,
               SINKS: tl.constexpr, WINDOW: tl.constexpr, OUT_DTYPE: tl.constexpr, TILE: tl.constexpr,
               DIM_PAD: tl.constexpr):
    """A [TILE, DIM_PAD] tile of K or V in OUT_DTYPE for `positions` of one sequence and KV head.

    head_dim a power of 2 (DIM_PAD == HEAD_DIM) takes the fast path: scales loaded once per token
    and group, int4 bytes loaded once and their two nibbles joined into [low half | high half]."""
    mask = valid[:, None] & dim_mask[None, :]
    rows = blocks * stride_block + offsets * stride_token + kv_head * stride_head
    if FORMAT == 0:
        return tl.load(ptr + rows[:, None] + dims[None, :], mask=mask, other=0.0).to(OUT_DTYPE)
    FAST: tl.constexpr = DIM_PAD == HEAD_DIM
    HALF: tl.constexpr = HEAD_DIM // 2
    if FORMAT == 3:
        if FAST:
            halves = tl.arange(0, HALF)
            byte = tl.load(ptr + rows[:, None] + halves[None, :], mask=valid[:, None], other=0x88)
            low = (byte & 0xF).to(tl.float32) - 8.0
            high = (byte >> 4).to(tl.float32) - 8.0
            # join -> [TILE, HALF, 2]; permute -> [TILE, 2, HALF]; reshape -> [low | high].
            codes = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (TILE, HEAD_DIM))
        else:
            byte = tl.load(ptr + rows[:, None] + (dims % HALF)[None, :], mask=mask, other=0x88)
            shift = tl.where(dims >= HALF, 4, 0).to(tl.uint8)
            codes = ((byte >> shift[None, :]) & 0xF).to(tl.float32) - 8.0
    elif FORMAT == 2:
        byte = tl.load(ptr + rows[:, None] + dims[None, :], mask=mask, other=0)
        codes = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        codes = tl.load(ptr + rows[:, None] + dims[None, :], mask=mask, other=0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr + kv_head * HEAD_DIM + dims, mask=dim_mask, other=1.0)[None, :]
    else:
        scale_rows = blocks * scales_stride_block + offsets * scales_stride_token + kv_head * scales_stride_head
        if FAST:
            scale = _tile_scales(scales_ptr, scale_rows, valid, TILE, HEAD_DIM // GROUP, GROUP)
        else:
            scale = tl.load(scales_ptr + scale_rows[:, None] + (dims // GROUP)[None, :], mask=mask,
                            other=0.0).to(tl.float32)
    values = (codes * scale).to(OUT_DTYPE)
    if SINKS + WINDOW > 0:
        in_ring = positions < SINKS
        ring_index = positions
        if WINDOW > 0:
            in_ring = in_ring | (positions >= context_len - WINDOW)
            ring_index = tl.where(positions < SINKS, positions, SINKS + positions % WINDOW)
        in_ring = in_ring & valid
        ring_rows = (seq_row * (SINKS + WINDOW) + ring_index).to(tl.int64) * ring_stride_token \
            + kv_head * ring_stride_head
        exact = tl.load(ring_ptr + ring_rows[:, None] + dims[None, :], mask=in_ring[:, None] & dim_mask[None, :],
                        other=0.0).to(OUT_DTYPE)
        values = tl.where(in_ring[:, None], exact, values)
    return values


@triton.jit(do_not_specialize=["num_splits", "block_table_stride_seq", "block_size", "write_final"])
def _decode_split_quant_kernel(
        query_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, k_static_ptr, v_static_ptr, k_ring_ptr, v_ring_ptr,
        seq_rows_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, partial_out_ptr, partial_lse_ptr,
        scale_log2, num_splits, block_size, write_final,
        query_stride_seq, query_stride_head,
        out_stride_seq, out_stride_head,
        block_table_stride_seq,
        k_stride_block, k_stride_token, k_stride_head, v_stride_block, v_stride_token, v_stride_head,
        ks_stride_block, ks_stride_token, ks_stride_head, vs_stride_block, vs_stride_token, vs_stride_head,
        ring_stride_token, ring_stride_head,
        partial_stride_seq, partial_stride_head, partial_stride_split,
        lse_stride_seq, lse_stride_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        TILE: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        K_FORMAT: tl.constexpr, V_FORMAT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
        K_STATIC: tl.constexpr, V_STATIC: tl.constexpr, K_RING: tl.constexpr, V_RING: tl.constexpr,
        SINKS: tl.constexpr, WINDOW: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    split_len = _split_length(context_len, num_splits, TILE, MIN_SPLIT_TOKENS)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)
    if write_final == 0:
        if start >= context_len:
            return
    seq_row = 0
    if K_RING or V_RING:
        seq_row = tl.load(seq_rows_ptr + seq).to(tl.int64)

    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + groups
    group_mask = groups < GROUP
    dim_mask = dims < HEAD_DIM
    q_mask = group_mask[:, None] & dim_mask[None, :]
    query = tl.load(query_ptr + seq * query_stride_seq + heads[:, None] * query_stride_head + dims[None, :],
                    mask=q_mask, other=0.0)
    if DOT_UPCAST:
        query = query.to(tl.float32)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    value_dtype: tl.constexpr = query_ptr.dtype.element_ty
    table_row = block_tables_ptr + seq * block_table_stride_seq
    for tile_start in range(start, end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < end
        blocks = tl.load(table_row + positions // block_size, mask=valid, other=0).to(tl.int64)
        offsets = positions % block_size
        keys = _load_part(k_ptr, k_scales_ptr, k_static_ptr, k_ring_ptr, blocks, offsets, positions, valid, dims,
                          dim_mask, kv_head, seq_row, context_len, k_stride_block, k_stride_token, k_stride_head,
                          ks_stride_block, ks_stride_token, ks_stride_head, ring_stride_token, ring_stride_head,
                          K_FORMAT, K_GROUP, K_STATIC, HEAD_DIM, SINKS if K_RING else 0, WINDOW if K_RING else 0,
                          query.dtype, TILE, DIM_PAD)
        values = _load_part(v_ptr, v_scales_ptr, v_static_ptr, v_ring_ptr, blocks, offsets, positions, valid, dims,
                            dim_mask, kv_head, seq_row, context_len, v_stride_block, v_stride_token, v_stride_head,
                            vs_stride_block, vs_stride_token, vs_stride_head, ring_stride_token, ring_stride_head,
                            V_FORMAT, V_GROUP, V_STATIC, HEAD_DIM, SINKS if V_RING else 0, WINDOW if V_RING else 0,
                            value_dtype, TILE, DIM_PAD)
        if USE_DOT:
            if DOT_UPCAST:
                scores = tl.dot(query, tl.trans(keys.to(tl.float32)))
            else:
                scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION)
        else:
            scores = tl.sum(query.to(tl.float32)[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        probs = probs.to(value_dtype)
        if USE_DOT:
            if DOT_UPCAST:
                update = tl.dot(probs.to(tl.float32), values.to(tl.float32))
            else:
                update = tl.dot(probs, values, input_precision=DOT_PRECISION)
        else:
            update = tl.sum(probs.to(tl.float32)[:, :, None] * values.to(tl.float32)[None, :, :], axis=1)
        acc = acc * rescale[:, None] + update
        running_max = new_max

    safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
    result = acc / safe_sum[:, None]
    if write_final != 0:
        tl.store(out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        tl.store(partial_out_ptr + seq * partial_stride_seq + heads[:, None] * partial_stride_head
                 + split * partial_stride_split + dims[None, :], result, mask=q_mask)
        tl.store(partial_lse_ptr + seq * lse_stride_seq + heads * lse_stride_head + split,
                 running_max + tl.log2(safe_sum), mask=group_mask)


def _part_args(cache, placeholder: torch.Tensor):
    """(payload, scales, static, ring, strides, scale strides, FORMAT, GROUP, STATIC, RING) of a part."""
    if isinstance(cache, torch.Tensor):
        return (cache, placeholder, placeholder, placeholder, cache.stride()[:3], (0, 0, 0), 0, 1, False, False)
    fmt, head_dim = cache.fmt, cache.head_dim
    scales = cache.scales if cache.scales is not None else placeholder
    scale_strides = cache.scales.stride()[:3] if cache.scales is not None else (0, 0, 0)
    static = cache.static_scale if cache.static_scale is not None else placeholder
    ring = cache.window if cache.window is not None else placeholder
    return (cache.payload, scales, static, ring, cache.payload.stride()[:3], scale_strides,
            FORMAT_CODES[fmt.name], fmt.group(head_dim), fmt.static_scales, cache.window is not None)


def paged_decode_attention_quant(query: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float, seq_rows: torch.Tensor | None = None, *,
                                 out: torch.Tensor | None = None, max_context_len: int | None = None,
                                 num_splits: int | None = None,
                                 workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                                 config: DecodeConfig | None = None) -> torch.Tensor:
    """decode_attention.paged_decode_attention over caches whose parts may be QuantizedKVCache;
    `seq_rows` [B] (each sequence's window row) is needed when a part keeps a window."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    config = config or default_decode_config(head_dim, query.dtype)
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    if config.use_dot:
        group_pad = max(16, group_pad)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, query.device, config)
    placeholder = query
    k_args, v_args = _part_args(k_cache, placeholder), _part_args(v_cache, placeholder)
    rings = [c for c in (k_cache, v_cache) if not isinstance(c, torch.Tensor) and c.window is not None]
    if rings and seq_rows is None:
        raise ValueError("a quantized part keeps a full-precision window: pass seq_rows")
    ring_strides = rings[0].window.stride()[:2] if rings else (0, 0)
    sinks, window = (rings[0].num_sinks, rings[0].window_size) if rings else (0, 0)
    interpret = interpreting()
    meta = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=max(16, next_power_of_2(head_dim)),
                TILE=config.tile, MIN_SPLIT_TOKENS=config.min_split_tokens,
                USE_DOT=config.use_dot, DOT_UPCAST=interpret,
                DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
                K_FORMAT=k_args[6], V_FORMAT=v_args[6], K_GROUP=k_args[7], V_GROUP=v_args[7],
                K_STATIC=k_args[8], V_STATIC=v_args[8], K_RING=k_args[9], V_RING=v_args[9],
                SINKS=sinks, WINDOW=window, num_warps=config.num_warps, num_stages=config.num_stages)
    common = (query, k_args[0], v_args[0], k_args[1], v_args[1], k_args[2], v_args[2], k_args[3], v_args[3],
              seq_rows if seq_rows is not None else context_lens, block_tables, context_lens)
    strides = (*k_args[4], *v_args[4], *k_args[5], *v_args[5], *ring_strides)
    scale_log2 = float(scale) * LOG2_E
    if num_splits == 1:
        _decode_split_quant_kernel[(batch, num_kv_heads, 1)](
            *common, out, out, out, scale_log2, 1, block_size, 1,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            *strides, 0, 0, 0, 0, 0, **meta)
        return out
    if workspace is None:
        workspace = decode_workspace(batch, num_heads, head_dim, num_splits, query.device)
    partial_out, partial_lse = workspace
    _decode_split_quant_kernel[(batch, num_kv_heads, num_splits)](
        *common, out, partial_out, partial_lse, scale_log2, num_splits, block_size, 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *strides, partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), **meta)
    _decode_combine_kernel[(batch, num_heads)](
        partial_out, partial_lse, context_lens, out, num_splits,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=meta["DIM_PAD"], TILE=config.tile,
        MIN_SPLIT_TOKENS=config.min_split_tokens, SPLIT_CHUNK=64 if head_dim <= 128 else 32,
        num_warps=4)
    return out

"""Pipelined fused-dequant paged decode attention for 8-bit and int4 KV caches (Gluon; NVIDIA sm_80+).

Reference: `kvserve.kernels.quant_reference.paged_decode_attention`; the same grid, split-KV scheme,
partial-output layout and combine kernel as decode_attention_quant.py, whose Triton kernels serve
every other case (static scales, int4 next to an 8-bit part, fp32 queries, the interpreter) and the
positions a full-precision window holds (SINKS, WINDOW: this kernel's splits skip them).

Why a second kernel: the Triton one is latency-bound. Each loop iteration waits for its own K/V
bytes, then runs its dependent chain of dots and reductions, so a program never has a tile in
flight while it computes (Triton 3.6's pipeliner leaves the gathered block-table loads in the same
iteration: docs/kv_quantization.md). Here the loop is written out with explicit asynchronous copies
into a ring of STAGES shared-memory buffers: while tile i is computed, tiles i+1 .. i+STAGES-1 are
on their way. Block ids for the copies are loaded one iteration before the copies that use them,
and the 2-byte per-token scales (too small for an asynchronous copy) one tile ahead of their use,
from block ids loaded one iteration earlier still; so no load waits in the iteration that issues it.

What it covers (`pipelined_supported`): K and V each int8 or fp8-e4m3 with dynamic per-token
scales, or both int4 with dynamic scales per group of 32-128 elements; with or without a
full-precision window (both parts alike, where the fast Triton kernel can run its positions);
head_dim 64 or 128; a GQA group of at most 8; fp16/bf16 queries.

8-bit codes become exact fp16 values by byte permutes under an fp16 exponent (int8) or the packed
e4m3x2 -> f16x2 conversion (code_conversion.py); key scales multiply the [positions, group] scores,
value scales the probabilities (divided by the warp's largest scale in the tile, which multiplies
the update). Keys are read from shared memory straight into the dot's operand registers (4
consecutive bytes per 32-bit load, converted in place); 8-bit value codes are converted to fp16 and
staged once more in shared memory, because P @ V reduces over positions, which are not adjacent in
a row of codes.

int4 (a byte holds dims j and head_dim/2 + j) does less per code: one LOP3 turns two nibbles into
fp16 values that keep an offset (1024 + n, or 1024 + 16n for high nibbles), and the offset leaves
once per dot, through the dot's initial accumulator (-1032 or -1152 times the sum of the other
operand), instead of once per value (INT4_TO_OFFSET_F16_PTX). Keys: per chunk of min(group,
head_dim/2) bytes, a dot for the low nibbles and one for the high, each times its group's scale (the
query's dims follow the converted codes' order). Values skip the staging: the ring slot is read as
16-bit byte pairs by transposing loads (ldmatrix.trans), which leaves each thread the same byte pair
at two consecutive positions, exactly the pair of positions the value dot's operand register holds;
one LOP3 per two values converts it in place, into four accumulators per 32 code bytes (low/high
nibbles of even/odd bytes). A group's scale reaches its dots through the probabilities, as for
8-bit values. Measured on an H200 (32k context, batch 32, Qwen-7B attention;
benchmarks/results/kv_quant_attention_h200_session11.json): int4 2.09x bf16 with groups of 32, 2.19x
with groups of 128.
"""

from __future__ import annotations

import torch

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves every case.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

from kvserve.kernels.triton._common import SPLIT_DECODE_DYNAMIC_ARGS, cuda_capability, interpreting
from kvserve.kernels.triton.code_conversion import (BF16_QUERY_PRESCALE, E4M3_TO_F16_PTX, INT4_HIGH_OFFSET,
                                                    INT4_LOW_OFFSET, INT4_TO_OFFSET_F16_PTX, INT8_TO_F16_PTX)
from kvserve.kernels.triton.decode_attention import DecodeConfig
from kvserve.kernels.triton.kv_store_quant import FORMAT_CODES

# The GQA group is the N side (8 columns) of mma.m16n8k16: every R1-Distill model's group fits.
HEADS_PER_PROGRAM = 8
NUM_WARPS = 4


if HAVE_GLUON:
    @gluon.jit
    def _to_f16(codes, FORMAT: gl.constexpr):
        if FORMAT == 1:
            values = gl.inline_asm_elementwise(INT8_TO_F16_PTX, "=r,=r,r", [codes], dtype=gl.float16,
                                               is_pure=True, pack=4)
        else:
            values = gl.inline_asm_elementwise(E4M3_TO_F16_PTX, "=r,=r,r", [codes], dtype=gl.float16,
                                               is_pure=True, pack=4)
        return values

    @gluon.jit
    def _tile_positions(tile_start, WARPS: gl.constexpr, SUB: gl.constexpr, layout: gl.constexpr):
        """[WARPS, SUB] positions of a tile: warp w owns positions w*SUB .. w*SUB + SUB-1."""
        warps = gl.arange(0, WARPS, layout=gl.SliceLayout(1, layout))
        subs = gl.arange(0, SUB, layout=gl.SliceLayout(0, layout))
        return tile_start + warps[:, None] * SUB + subs[None, :]

    @gluon.jit
    def _block_ids(table_row, positions, end, LOG2_BLOCK: gl.constexpr):
        """Block ids of a tile's positions (0 past `end`: a real block, whose reads are masked)."""
        # Positions are >= 0 and BLOCK_SIZE a power of 2: a shift, without a signed division's fix-ups.
        return gl.load(table_row + (positions >> LOG2_BLOCK), mask=positions < end, other=0)

    @gluon.jit
    def _int4_to_offset_f16(codes):
        """int4 bytes -> (1024 + low nibble, 1024 + 16 * high nibble) as exact fp16 values, each 4 bytes'
        worth in the order (b0, b2, b1, b3): see INT4_TO_OFFSET_F16_PTX."""
        return gl.inline_asm_elementwise(INT4_TO_OFFSET_F16_PTX, "=r,=r,=r,=r,r", [codes],
                                         dtype=(gl.float16, gl.float16), is_pure=True, pack=4)

    @gluon.jit
    def _int4_order(index):
        """The code byte (and so the dim) behind element `index` of a converted int4 row: within each
        4, elements 1 and 2 swap (an involution, so it also maps dims back to elements)."""
        return (index & -4) | ((index & 1) << 1) | ((index >> 1) & 1)

    @gluon.jit
    def _pick(x0, x1, x2, x3, INDEX: gl.constexpr):
        """x<INDEX> of up to 4 per-chunk or per-group values (compile-time choice)."""
        if INDEX == 0:
            picked = x0
        elif INDEX == 1:
            picked = x1
        elif INDEX == 2:
            picked = x2
        else:
            picked = x3
        return picked

    @gluon.jit
    def _issue_tile(k_ptr, v_ptr, k_buf, v_buf, blocks, positions, end,
                    k_stride_block, k_stride_token, k_head_offset, v_stride_block, v_stride_token, v_head_offset,
                    ROW_BYTES: gl.constexpr, BLOCK_SIZE: gl.constexpr, copy: gl.constexpr):
        """Asynchronous copies of a tile's K and V codes ([WARPS, SUB] positions, ROW_BYTES each) into
        one ring slot (zeros past `end`)."""
        valid = positions < end
        offsets = positions & (BLOCK_SIZE - 1)
        cols = gl.arange(0, ROW_BYTES, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy)))[None, None, :]
        base = blocks.to(gl.int64)
        k_rows = base * k_stride_block + (offsets * k_stride_token + k_head_offset)
        async_copy.async_copy_global_to_shared(k_buf, k_ptr + k_rows[:, :, None] + cols, mask=valid[:, :, None])
        v_rows = base * v_stride_block + (offsets * v_stride_token + v_head_offset)
        async_copy.async_copy_global_to_shared(v_buf, v_ptr + v_rows[:, :, None] + cols, mask=valid[:, :, None])

    @gluon.jit
    def _group_scales(scales_ptr, blocks, positions, end, stride_block, stride_token, head_offset,
                      NUM_GROUPS: gl.constexpr, BLOCK_SIZE: gl.constexpr):
        """fp16 [WARPS, SUB] scales of each of a tile's (up to 4) scale groups (0 past `end`; entries
        past NUM_GROUPS repeat the first). A position's 2 or 4 scales are adjacent (and aligned:
        pipelined_supported), so they come in one 4- or 8-byte load and are split in registers."""
        rows = blocks.to(gl.int64) * stride_block + ((positions & (BLOCK_SIZE - 1)) * stride_token + head_offset)
        valid = positions < end
        if NUM_GROUPS == 1:
            s0 = gl.load(scales_ptr + rows, mask=valid, other=0.0)
            s1 = s0
            s2 = s0
            s3 = s0
        elif NUM_GROUPS == 2:
            both = gl.load(scales_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + (rows >> 1), mask=valid, other=0)
            s0 = both.to(gl.int16).to(gl.float16, bitcast=True)
            s1 = (both >> 16).to(gl.int16).to(gl.float16, bitcast=True)
            s2 = s0
            s3 = s0
        else:
            lo = gl.load(scales_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + (rows >> 1), mask=valid, other=0)
            hi = gl.load(scales_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + (rows >> 1) + 1, mask=valid, other=0)
            s0 = lo.to(gl.int16).to(gl.float16, bitcast=True)
            s1 = (lo >> 16).to(gl.int16).to(gl.float16, bitcast=True)
            s2 = hi.to(gl.int16).to(gl.float16, bitcast=True)
            s3 = (hi >> 16).to(gl.int16).to(gl.float16, bitcast=True)
        return s0, s1, s2, s3

    @gluon.jit
    def _query_chunk(q_base, query_stride_head, kv_head, DIM0: gl.constexpr, WIDTH: gl.constexpr,
                     GROUP: gl.constexpr, HEADS: gl.constexpr, WARPS: gl.constexpr, PRESCALE: gl.constexpr,
                     INT4: gl.constexpr, operand: gl.constexpr, sums: gl.constexpr):
        """(q^T [WIDTH, 8] of the group over dims DIM0 .. DIM0 + WIDTH (heads past GROUP are 0), times
        PRESCALE (a power of 2, so that any bf16 value fits fp16), the same for every warp; its fp32 sum
        over the dims, per head, in layout `sums`). For int4 keys the dims follow the converted codes'
        order (_int4_order)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8, 1], [1, 4, 8], [WARPS, 1, 1], [1, 2, 0])
        dims = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        if INT4:
            dims = _int4_order(dims)
        heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        warps = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        ptrs = (q_base + warps[:, None, None] * 0 + (kv_head * GROUP + heads)[None, None, :] * query_stride_head
                + (DIM0 + dims)[None, :, None])
        q = (gl.load(ptrs, mask=(heads < GROUP)[None, None, :], other=0.0).to(gl.float32) * PRESCALE).to(gl.float16)
        return gl.convert_layout(q, operand), gl.convert_layout(gl.sum(q.to(gl.float32), axis=1), sums)

    @gluon.jit
    def _offset_dot(codes, q, q_sum, OFFSET: gl.constexpr, zero):
        """codes . q minus OFFSET * sum(q): the dot of offset int4 codes (_int4_to_offset_f16) with the
        offset removed, which enters as the dot's initial accumulator (no instruction per value)."""
        return mma_v2(codes, q, zero - OFFSET * q_sum[:, None, :])

    @gluon.jit
    def _key_scores(k_buf, q0, q1, q2, q3, qs0, qs1, qs2, qs3, s0, s1, s2, s3, FORMAT: gl.constexpr,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr, k_operand: gl.constexpr, zero):
        """[WARPS, SUB, 8] scores^T (q . k, key scales applied) of the tile in one ring slot. 8-bit:
        one dot over the whole head; int4: per chunk of CHUNK bytes, a dot for its low nibbles (dims
        c*CHUNK ..) and one for its high nibbles (dims HEAD_DIM/2 + c*CHUNK ..), each times its
        group's per-token scale (/16 for the high nibbles, which convert as 16 * nibble)."""
        if FORMAT == 3:
            HALF: gl.constexpr = HEAD_DIM // 2
            NC: gl.constexpr = HALF // CHUNK
            low, high = _int4_to_offset_f16(k_buf.slice(0, CHUNK, dim=2).load(k_operand))
            scores = _offset_dot(low, q0, qs0, INT4_LOW_OFFSET, zero) \
                * _pick(s0, s1, s2, s3, 0).to(gl.float32)[:, :, None]
            scores += _offset_dot(high, _pick(q0, q1, q2, q3, NC), _pick(qs0, qs1, qs2, qs3, NC), INT4_HIGH_OFFSET,
                                  zero) * (_pick(s0, s1, s2, s3, HALF // GROUP).to(gl.float32) * 0.0625)[:, :, None]
            if NC > 1:
                low, high = _int4_to_offset_f16(k_buf.slice(CHUNK, CHUNK, dim=2).load(k_operand))
                scores += _offset_dot(low, q1, qs1, INT4_LOW_OFFSET, zero) \
                    * _pick(s0, s1, s2, s3, CHUNK // GROUP).to(gl.float32)[:, :, None]
                scores += _offset_dot(high, q3, qs3, INT4_HIGH_OFFSET, zero) \
                    * (_pick(s0, s1, s2, s3, (HALF + CHUNK) // GROUP).to(gl.float32) * 0.0625)[:, :, None]
        else:
            scores = mma_v2(_to_f16(k_buf.load(k_operand), FORMAT), q0, zero) * s0.to(gl.float32)[:, :, None]
        return scores

    @gluon.jit
    def _chunk_update(v_stage, weights, top, v_operand: gl.constexpr, zero):
        """8-bit values: out^T [WARPS, HEAD_DIM, 8] update from the staged fp16 values."""
        values = v_stage.permute([0, 2, 1]).load(v_operand)
        return mma_v2(values, weights, zero) * top[:, None, None]

    @gluon.jit
    def _pair_slice_update(v_pairs, acc_low_even, acc_low_odd, acc_high_even, acc_high_odd, rescale,
                           low_weights, low_top, low_sum, high_weights, high_top, high_sum, SLICE: gl.constexpr,
                           v_operand: gl.constexpr, zero):
        """int4 values, straight from the ring slot: code bytes 32*SLICE .. 32*SLICE + 31 of every position,
        read as 16-bit pairs by transposing loads (ldmatrix.trans), so a thread's 32-bit register holds
        one byte pair at two consecutive positions: exactly what one LOP3 per two values turns into the
        value dot's operand, (position p, p+1) of one dim (INT4_TO_OFFSET_F16_PTX). The four results
        are the low nibbles of the pairs' even and odd bytes (dims 32*SLICE + 2m and + 2m + 1) and the
        high nibbles (the same + HEAD_DIM/2), each updating its own [WARPS, 16, 8] accumulator."""
        codes = v_pairs.slice(16 * SLICE, 16, dim=2).permute([0, 2, 1]).load(v_operand)
        low_even, low_odd, high_even, high_odd = gl.inline_asm_elementwise(
            INT4_TO_OFFSET_F16_PTX, "=r,=r,=r,=r,r", [codes], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True, pack=2)
        low_top = low_top[:, None, None]
        high_top = (high_top * 0.0625)[:, None, None]
        acc_low_even = acc_low_even * rescale + _offset_dot(low_even, low_weights, low_sum, INT4_LOW_OFFSET, zero) * low_top
        acc_low_odd = acc_low_odd * rescale + _offset_dot(low_odd, low_weights, low_sum, INT4_LOW_OFFSET, zero) * low_top
        acc_high_even = acc_high_even * rescale \
            + _offset_dot(high_even, high_weights, high_sum, INT4_HIGH_OFFSET, zero) * high_top
        acc_high_odd = acc_high_odd * rescale \
            + _offset_dot(high_odd, high_weights, high_sum, INT4_HIGH_OFFSET, zero) * high_top
        return acc_low_even, acc_low_odd, acc_high_even, acc_high_odd

    @gluon.jit
    def _scaled_weights(probs, scales, INT4: gl.constexpr, p_operand: gl.constexpr):
        """(p * s / max s in fp16 as the dot's operand, max s, and for int4 the fp16 weights' sum over
        the positions) per warp: the probabilities times each position's value scale, divided by the
        warp's largest (so fp16 keeps them in [0, 1])."""
        value_scales = scales.to(gl.float32)
        top = gl.maximum(gl.max(value_scales, axis=1), 1e-30)
        weights = (probs * (value_scales / top[:, None])[:, :, None]).to(gl.float16)
        weight_sum = top
        if INT4:
            weight_sum = gl.sum(weights.to(gl.float32), axis=1)
        return gl.convert_layout(weights, p_operand), top, weight_sum

    @gluon.jit
    def _store_chunk(acc, factors, safe_sum, out_ptr, partial_out_ptr, seq, kv_head, split, write_final,
                     out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head, partial_stride_split,
                     DIM0: gl.constexpr, STEP: gl.constexpr, ROWS: gl.constexpr, GROUP: gl.constexpr,
                     HEADS: gl.constexpr, mma: gl.constexpr):
        """Merge one accumulator across warps and store its ROWS dims, DIM0 + STEP * row, of the output
        (or of this split's partial output)."""
        out_layout: gl.constexpr = gl.SliceLayout(0, mma)
        merged = gl.sum(acc * factors[:, None, :], axis=0)
        result = merged / gl.convert_layout(safe_sum, gl.SliceLayout(0, out_layout))[None, :]
        dims = DIM0 + STEP * gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout))
        groups = gl.arange(0, HEADS, layout=gl.SliceLayout(0, out_layout))
        heads = kv_head * GROUP + groups
        group_mask = groups < GROUP
        if write_final != 0:
            gl.store(out_ptr + seq * out_stride_seq + heads[None, :] * out_stride_head + dims[:, None],
                     result.to(out_ptr.dtype.element_ty), mask=group_mask[None, :])
        else:
            gl.store(partial_out_ptr + seq * partial_stride_seq + heads[None, :] * partial_stride_head
                     + split * partial_stride_split + dims[:, None], result, mask=group_mask[None, :])

    @gluon.jit(do_not_specialize=SPLIT_DECODE_DYNAMIC_ARGS)
    def _decode_split_pipelined_kernel(
            query_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, context_lens_ptr,
            out_ptr, partial_out_ptr, partial_lse_ptr,
            key_scale_log2, num_splits, write_final,
            query_stride_seq, query_stride_head, out_stride_seq, out_stride_head,
            block_table_stride_seq,
            k_stride_block, k_stride_token, k_stride_head, v_stride_block, v_stride_token, v_stride_head,
            ks_stride_block, ks_stride_token, ks_stride_head, vs_stride_block, vs_stride_token, vs_stride_head,
            partial_stride_seq, partial_stride_head, partial_stride_split,
            lse_stride_seq, lse_stride_head,
            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, TILE: gl.constexpr, STAGES: gl.constexpr,
            MIN_SPLIT_TOKENS: gl.constexpr, K_FORMAT: gl.constexpr, V_FORMAT: gl.constexpr,
            K_GROUP: gl.constexpr, V_GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr, PRESCALE: gl.constexpr,
            SINKS: gl.constexpr, WINDOW: gl.constexpr):
        WARPS: gl.constexpr = 4
        SUB: gl.constexpr = TILE // WARPS
        LOG2_BLOCK: gl.constexpr = BLOCK_SIZE.bit_length() - 1
        HEADS: gl.constexpr = 8
        # Bytes per position and head: both parts 8-bit, or both int4 (two codes per byte: dims j and
        # HEAD_DIM/2 + j). int4 key dots go in chunks of K_CHUNK dims that share a scale; int4 values in
        # slices of 32 code bytes (one scale group for each nibble half: V_GROUP >= 32), one accumulator
        # per nibble half and byte parity, [WARPS, 16, 8] each.
        INT4: gl.constexpr = K_FORMAT == 3
        HALF: gl.constexpr = HEAD_DIM // 2
        ROW_BYTES: gl.constexpr = HALF if INT4 else HEAD_DIM
        K_CHUNK: gl.constexpr = min(K_GROUP, ROW_BYTES) if INT4 else HEAD_DIM
        K_CHUNKS: gl.constexpr = HEAD_DIM // K_CHUNK
        SLICES: gl.constexpr = ROW_BYTES // 32
        ACC_ROWS: gl.constexpr = 16 if INT4 else HEAD_DIM
        # Every warp runs its own online softmax over its SUB positions of each tile (merged across warps
        # once, at the end), so the loop has no cross-warp reduction. The dots are transposed (keys and
        # values are the M side, the GQA group the N = 8 side of mma.m16n8k16): scores^T [SUB, 8] =
        # K [SUB, D] q^T [D, 8] and out^T [D, 8] += V^T [D, SUB] p^T [SUB, 8], which wastes no rows
        # on padding heads and keeps the accumulator at [D, 8] per warp.
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        # Keys enter with 4 consecutive channels per 32-bit register (one shared-memory load of 4
        # codes, converted in place); the query operand's channel order matches.
        k_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        q_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
        v_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # Copies and value conversion: 16 codes (16 bytes) per thread and row; warp w copies its rows.
        copy: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32 * 16 // ROW_BYTES, ROW_BYTES // 16], [WARPS, 1, 1],
                                              [2, 1, 0])
        CHUNKS: gl.constexpr = ROW_BYTES // 16
        codes_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=8 // CHUNKS, max_phase=CHUNKS,
                                                            order=[2, 1, 0])
        values_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])
        # The int4 value codes' ring slot seen as 16-bit byte pairs: the same 16-byte swizzle.
        pairs_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=8 // CHUNKS, max_phase=CHUNKS,
                                                            order=[2, 1, 0])
        rows: gl.constexpr = gl.SliceLayout(2, copy)           # [WARPS, SUB] positions for the copies
        token_rows: gl.constexpr = gl.SliceLayout(2, mma)      # [WARPS, SUB] positions of the scores
        head_cols: gl.constexpr = gl.SliceLayout(1, mma)       # [WARPS, 8] per-warp softmax state

        seq = gl.program_id(0).to(gl.int64)
        kv_head = gl.program_id(1)
        split = gl.program_id(2)
        context_len = gl.load(context_lens_ptr + seq).to(gl.int32)
        per_split = gl.maximum((context_len + num_splits - 1) // num_splits, MIN_SPLIT_TOKENS)
        split_len = (per_split + TILE - 1) // TILE * TILE
        start = split * split_len
        end = gl.minimum(start + split_len, context_len)
        if write_final == 0:
            if start >= context_len:
                return
        if SINKS + WINDOW > 0:
            # A full-precision window: this split's quantized positions are those past the sinks and
            # before the window (maybe none: its partial is then empty, lse -inf); another launch runs
            # the ring's (decode_attention_quant.paged_decode_attention_quant).
            start = gl.maximum(start, SINKS)
            end = gl.minimum(end, gl.maximum(context_len - WINDOW, SINKS))

        q_base = query_ptr + seq * query_stride_seq
        q0, qs0 = _query_chunk(q_base, query_stride_head, kv_head, 0, K_CHUNK, GROUP, HEADS, WARPS, PRESCALE, INT4,
                               q_operand, head_cols)
        q1, qs1 = q0, qs0
        q2, qs2 = q0, qs0
        q3, qs3 = q0, qs0
        if K_CHUNKS > 1:
            q1, qs1 = _query_chunk(q_base, query_stride_head, kv_head, K_CHUNK, K_CHUNK, GROUP, HEADS, WARPS,
                                   PRESCALE, INT4, q_operand, head_cols)
        if K_CHUNKS > 2:
            q2, qs2 = _query_chunk(q_base, query_stride_head, kv_head, 2 * K_CHUNK, K_CHUNK, GROUP, HEADS, WARPS,
                                   PRESCALE, INT4, q_operand, head_cols)
            q3, qs3 = _query_chunk(q_base, query_stride_head, kv_head, 3 * K_CHUNK, K_CHUNK, GROUP, HEADS, WARPS,
                                   PRESCALE, INT4, q_operand, head_cols)

        k_bufs = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [STAGES, WARPS, SUB, ROW_BYTES], codes_smem)
        v_bufs = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [STAGES, WARPS, SUB, ROW_BYTES], codes_smem)
        if not INT4:
            v_stage = gl.allocate_shared_memory(gl.float16, [WARPS, SUB, HEAD_DIM], values_smem)

        table_row = block_tables_ptr + seq * block_table_stride_seq
        k_head = kv_head * k_stride_head
        v_head = kv_head * v_stride_head
        ks_head = kv_head * ks_stride_head
        vs_head = kv_head * vs_stride_head
        K_GROUPS: gl.constexpr = HEAD_DIM // K_GROUP
        V_GROUPS: gl.constexpr = HEAD_DIM // V_GROUP

        # Prologue: tiles 0 .. STAGES-2 in flight, one commit group each.
        for s in gl.static_range(STAGES - 1):
            positions = _tile_positions(start + s * TILE, WARPS, SUB, rows)
            blocks = _block_ids(table_row, positions, end, LOG2_BLOCK)
            _issue_tile(k_ptr, v_ptr, k_bufs.index(s), v_bufs.index(s), blocks, positions, end,
                        k_stride_block, k_stride_token, k_head, v_stride_block, v_stride_token, v_head,
                        ROW_BYTES, BLOCK_SIZE, copy)
            async_copy.commit_group()
        copy_blocks = _block_ids(table_row, _tile_positions(start + (STAGES - 1) * TILE, WARPS, SUB, rows), end,
                                 LOG2_BLOCK)
        positions = _tile_positions(start, WARPS, SUB, token_rows)
        scale_blocks = _block_ids(table_row, positions, end, LOG2_BLOCK)
        ks0, ks1, ks2, ks3 = _group_scales(k_scales_ptr, scale_blocks, positions, end, ks_stride_block,
                                           ks_stride_token, ks_head, K_GROUPS, BLOCK_SIZE)
        vs0, vs1, vs2, vs3 = _group_scales(v_scales_ptr, scale_blocks, positions, end, vs_stride_block,
                                           vs_stride_token, vs_head, V_GROUPS, BLOCK_SIZE)
        running_max = gl.full([WARPS, HEADS], float("-inf"), gl.float32, layout=head_cols)
        running_sum = gl.zeros([WARPS, HEADS], gl.float32, layout=head_cols)
        acc0 = gl.zeros([WARPS, ACC_ROWS, HEADS], gl.float32, layout=mma)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        acc4 = acc0
        acc5 = acc0
        acc6 = acc0
        acc7 = acc0
        score_zero = gl.zeros([WARPS, SUB, HEADS], gl.float32, layout=mma)
        scale_blocks = _block_ids(table_row, positions + TILE, end, LOG2_BLOCK)
        num_tiles = (end - start + TILE - 1) // TILE
        for index in range(num_tiles):
            tile_start = start + index * TILE
            positions = _tile_positions(tile_start, WARPS, SUB, token_rows)
            # Loads for later tiles first: nothing below waits on them in this iteration.
            nks0, nks1, nks2, nks3 = _group_scales(k_scales_ptr, scale_blocks, positions + TILE, end, ks_stride_block,
                                                   ks_stride_token, ks_head, K_GROUPS, BLOCK_SIZE)
            nvs0, nvs1, nvs2, nvs3 = _group_scales(v_scales_ptr, scale_blocks, positions + TILE, end, vs_stride_block,
                                                   vs_stride_token, vs_head, V_GROUPS, BLOCK_SIZE)
            scale_blocks = _block_ids(table_row, positions + 2 * TILE, end, LOG2_BLOCK)
            # This tile's copies are done (this thread's), then every thread's are, and every thread has
            # finished reading the slot the next copies overwrite (the previous iteration's).
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            slot_ahead = (index + STAGES - 1) % STAGES
            ahead = _tile_positions(tile_start + (STAGES - 1) * TILE, WARPS, SUB, rows)
            _issue_tile(k_ptr, v_ptr, k_bufs.index(slot_ahead), v_bufs.index(slot_ahead), copy_blocks, ahead, end,
                        k_stride_block, k_stride_token, k_head, v_stride_block, v_stride_token, v_head,
                        ROW_BYTES, BLOCK_SIZE, copy)
            async_copy.commit_group()
            copy_blocks = _block_ids(table_row, ahead + TILE, end, LOG2_BLOCK)

            slot = index % STAGES
            scores = _key_scores(k_bufs.index(slot), q0, q1, q2, q3, qs0, qs1, qs2, qs3, ks0, ks1, ks2, ks3,
                                 K_FORMAT, K_GROUP, HEAD_DIM, K_CHUNK, k_operand, score_zero)
            scores = gl.where((positions < end)[:, :, None], scores * key_scale_log2, float("-inf"))
            new_max = gl.maximum(running_max, gl.max(scores, axis=1))
            # A warp with no position yet (all of its positions past `end`) keeps max -inf; exp2(-inf - -inf)
            # would be NaN, so it subtracts 0 instead (its probabilities are exp2(-inf) = 0).
            safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = gl.exp2(running_max - safe_max)
            probs = gl.exp2(scores - safe_max[:, None, :])
            running_sum = running_sum * rescale + gl.sum(probs, axis=1)
            running_max = new_max
            rescale = rescale[:, None, :]

            weights0, top0, wsum0 = _scaled_weights(probs, vs0, INT4, p_operand)
            zero = gl.zeros([WARPS, ACC_ROWS, HEADS], gl.float32, layout=mma)
            if INT4:
                weights1, top1, wsum1 = weights0, top0, wsum0
                weights2, top2, wsum2 = weights0, top0, wsum0
                weights3, top3, wsum3 = weights0, top0, wsum0
                if V_GROUPS > 1:
                    weights1, top1, wsum1 = _scaled_weights(probs, vs1, INT4, p_operand)
                if V_GROUPS > 2:
                    weights2, top2, wsum2 = _scaled_weights(probs, vs2, INT4, p_operand)
                    weights3, top3, wsum3 = _scaled_weights(probs, vs3, INT4, p_operand)
                v_pairs = v_bufs.index(slot)._reinterpret(gl.int16, [WARPS, SUB, ROW_BYTES // 2], pairs_smem)
                L0: gl.constexpr = 0
                H0: gl.constexpr = HALF // V_GROUP
                acc0, acc1, acc2, acc3 = _pair_slice_update(
                    v_pairs, acc0, acc1, acc2, acc3, rescale,
                    _pick(weights0, weights1, weights2, weights3, L0), _pick(top0, top1, top2, top3, L0),
                    _pick(wsum0, wsum1, wsum2, wsum3, L0), _pick(weights0, weights1, weights2, weights3, H0),
                    _pick(top0, top1, top2, top3, H0), _pick(wsum0, wsum1, wsum2, wsum3, H0), 0, v_operand, zero)
                if SLICES > 1:
                    L1: gl.constexpr = 32 // V_GROUP
                    H1: gl.constexpr = (HALF + 32) // V_GROUP
                    acc4, acc5, acc6, acc7 = _pair_slice_update(
                        v_pairs, acc4, acc5, acc6, acc7, rescale,
                        _pick(weights0, weights1, weights2, weights3, L1), _pick(top0, top1, top2, top3, L1),
                        _pick(wsum0, wsum1, wsum2, wsum3, L1), _pick(weights0, weights1, weights2, weights3, H1),
                        _pick(top0, top1, top2, top3, H1), _pick(wsum0, wsum1, wsum2, wsum3, H1), 1, v_operand, zero)
            else:
                v_stage.store(_to_f16(v_bufs.index(slot).load(copy), V_FORMAT))
                gl.thread_barrier()
                acc0 = acc0 * rescale + _chunk_update(v_stage, weights0, top0, v_operand, zero)
            ks0 = nks0
            vs0 = nvs0
            if K_GROUPS > 1:
                ks1 = nks1
            if K_GROUPS > 2:
                ks2 = nks2
                ks3 = nks3
            if V_GROUPS > 1:
                vs1 = nvs1
            if V_GROUPS > 2:
                vs2 = nvs2
                vs3 = nvs3
        async_copy.wait_group(0)

        # Merge the warps' states: each warp's sum and accumulator rescaled to the common maximum.
        total_max = gl.max(running_max, axis=0)
        safe_max = gl.where(total_max == float("-inf"), 0.0, total_max)
        factors = gl.exp2(running_max - safe_max[None, :])
        total_sum = gl.sum(running_sum * factors, axis=0)
        factors = gl.convert_layout(factors, head_cols)
        # A row that saw no position (only for context_len == 0) has sum 0 and acc 0 -> 0.
        safe_sum = gl.where(total_sum > 0, total_sum, 1.0)
        if INT4:
            for part in gl.static_range(4 * SLICES):
                # part = 4 * slice + 2 * high + odd: dims 32 * slice + odd (+ HALF) + 2 * row.
                _store_chunk(_pick(_pick(acc0, acc1, acc2, acc3, part % 4), _pick(acc4, acc5, acc6, acc7, part % 4),
                                   acc0, acc0, part // 4),
                             factors, safe_sum, out_ptr, partial_out_ptr, seq, kv_head, split, write_final,
                             out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head,
                             partial_stride_split, 32 * (part // 4) + (part % 2) + HALF * ((part // 2) % 2), 2, 16,
                             GROUP, HEADS, mma)
        else:
            _store_chunk(acc0, factors, safe_sum, out_ptr, partial_out_ptr, seq, kv_head, split, write_final,
                         out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head, partial_stride_split,
                         0, 1, HEAD_DIM, GROUP, HEADS, mma)
        if write_final == 0:
            lse_groups = gl.arange(0, HEADS, layout=gl.SliceLayout(0, head_cols))
            gl.store(partial_lse_ptr + seq * lse_stride_seq + (kv_head * GROUP + lse_groups) * lse_stride_head
                     + split, total_max + gl.log2(safe_sum), mask=lse_groups < GROUP)


def pipelined_config(int4: bool = False) -> DecodeConfig:
    """Launch shape: 2 ring slots, so one tile is in flight while one is computed; tiles of 128
    positions (32 per warp) for 8-bit caches, 256 for int4, whose per-tile work (block ids, scale
    loads, barriers) then spreads over more positions. Measured on an H200 at 32k context, batch 32,
    bf16 queries (benchmarks/results/kv_quant_pipelined_h200.json, kv_quant_pipelined_int4_tiles_h200.json):
    8-bit: 128 beats 64 with 2 or 3 slots and 3 slots under a 128-register cap (spills); int4 groups
    of 32: 256 takes 0.233 ms against 0.252 at 128."""
    return DecodeConfig(tile=256 if int4 else 128, num_warps=NUM_WARPS, num_stages=2, min_split_tokens=128)


def _aligned(tensor: torch.Tensor) -> bool:
    """16-byte asynchronous copies: rows of codes start on 16-byte boundaries."""
    return (tensor.data_ptr() % 16 == 0 and tensor.stride(3) == 1
            and all(stride * tensor.element_size() % 16 == 0 for stride in tensor.stride()[:3]))


def _pairs_aligned(scales: torch.Tensor) -> bool:
    """Per-group scales come two (4 bytes) at a time: every position's row starts on 4 bytes."""
    return scales.data_ptr() % 4 == 0 and all(stride % 2 == 0 for stride in scales.stride()[:3])


def pipelined_supported(query: torch.Tensor, k_cache, v_cache) -> bool:
    """Whether this kernel serves these caches: see the module docstring."""
    if not HAVE_GLUON or interpreting() or query.device.type != "cuda" or torch.version.hip is not None:
        return False
    if query.dtype not in (torch.float16, torch.bfloat16):
        return False
    num_heads, head_dim = query.shape[1:]
    parts = (k_cache, v_cache)
    if any(isinstance(part, torch.Tensor) for part in parts):
        return False
    num_kv_heads = k_cache.shape[2]
    if head_dim not in (64, 128) or num_heads % num_kv_heads or num_heads // num_kv_heads > HEADS_PER_PROGRAM:
        return False
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        return False
    capability = cuda_capability(query.device)
    if (k_cache.fmt.name == "int4") != (v_cache.fmt.name == "int4"):
        return False                            # one ring layout: both parts int4, or both 8-bit
    for part in parts:
        fmt = part.fmt
        if fmt.name not in ("int8", "fp8_e4m3", "int4") or fmt.static_scales:
            return False
        if part.scales is None or not _aligned(part.payload):
            return False
        group = min(fmt.group(head_dim), head_dim)
        if fmt.name == "int4":
            # Key chunks of min(group, head_dim/2) dims and value slices of 32 code bytes share a scale.
            if group < 32 or group & (group - 1):
                return False
            if head_dim // group > 1 and not _pairs_aligned(part.scales):
                return False
        elif group != head_dim:
            return False
        if fmt.name == "fp8_e4m3" and capability < (8, 9):
            return False
    if any(part.window is not None for part in parts):
        # The ring's positions (sinks, window) go to the fast Triton kernel (RING_ONLY).
        from kvserve.kernels.triton.decode_attention_quant import fast_kernel_supported
        if not fast_kernel_supported(query, k_cache, v_cache):
            return False
    return capability >= (8, 0)


def launch_pipelined(grid: tuple[int, int, int], query: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale_log2: float, out: torch.Tensor, partial_out: torch.Tensor,
                     partial_lse: torch.Tensor, num_splits: int, write_final: int, config: DecodeConfig,
                     partial_strides: tuple[int, ...], ring: tuple[int, int] = (0, 0)):
    """One launch of the split kernel (decode_attention_quant.paged_decode_attention_quant does the
    split choice, workspace and combine); returns the compiled kernel (for its occupancy)."""
    num_heads, head_dim = query.shape[1:]
    prescale = BF16_QUERY_PRESCALE if query.dtype == torch.bfloat16 else 1.0
    extra = {"maxnreg": config.max_registers} if config.max_registers else {}
    return _decode_split_pipelined_kernel[grid](
        query, k_cache.payload, v_cache.payload, k_cache.scales, v_cache.scales, block_tables, context_lens,
        out, partial_out, partial_lse, scale_log2 / prescale, num_splits, write_final,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.payload.stride()[:3], *v_cache.payload.stride()[:3],
        *k_cache.scales.stride()[:3], *v_cache.scales.stride()[:3], *partial_strides,
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, TILE=config.tile, STAGES=config.num_stages,
        MIN_SPLIT_TOKENS=config.min_split_tokens, K_FORMAT=FORMAT_CODES[k_cache.fmt.name],
        V_FORMAT=FORMAT_CODES[v_cache.fmt.name], K_GROUP=min(k_cache.fmt.group(head_dim), head_dim),
        V_GROUP=min(v_cache.fmt.group(head_dim), head_dim), BLOCK_SIZE=k_cache.shape[1], PRESCALE=prescale,
        SINKS=ring[0], WINDOW=ring[1],
        num_warps=config.num_warps, **extra)

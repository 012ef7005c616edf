"""Paged decode attention that reads a quantized KV cache directly (fused dequantization).

Reference: `kvserve.kernels.quant_reference.paged_decode_attention`. Same grid and split-KV scheme as
decode_attention.py (batch x kv_heads x splits, the GQA group served from one K/V tile load, online
softmax in fp32, the same combine kernel and split heuristic), with each part (K, V)
read in its own format.

Fast kernel (`_decode_split_quant_kernel`; head_dim a power of 2, scale groups of >= 16 elements):
the head is cut into at most 4 *segments* of SEG columns whose elements share one scale per token
(the whole head for 8-bit per-token scales; each half of the head for int4, whose bytes hold
element i and i + head_dim/2; one group each for smaller groups). A segment's codes are converted
to exact fp16 values (int8, fp8-e4m3 and int4 codes all are fp16 numbers) and go into the
tensor-core dots unscaled; the scales are applied where they cost [group rows x tile] multiplies
instead of [tile x head_dim]:
- keys: q . (s_t k_t) = s_t (q . k_t): each segment's [heads, tile] scores times its per-token scale;
  static per-channel scales are folded into the query once per program;
- values: sum_t p_t s_t v_t: the probabilities times the segment's per-token scale (divided by the
  tile's largest scale, so fp16 keeps them in range; the update is multiplied back), one
  accumulator per segment; int4 chunks whose two nibbles have different groups scale the fp16
  codes instead (one packed multiply per two elements), so both dots share one probability
  operand; static per-channel scales multiply each tile's update.
Bytes become fp16 without the GPU's slow int/float conversion instructions: inline PTX puts each
code under an fp16 exponent (1024 + code) with byte permutes and subtracts the bias with packed
fp16 arithmetic (4 int8 or 8 int4 values per few instructions); e4m3 uses the hardware's packed
e4m3 -> f16 conversion. A bf16 query enters the fp16 dots scaled by 2^-8 (exact; keeps any bf16
magnitude inside fp16's range) and the scores are scaled back. fp32 queries (and the interpreter)
use the same structure with fp32 dots. Value codes are converted before their shared-memory
staging (an impure asm op keeps the compiler from moving the conversion after it), so the 16-bit
tile is read with transposing ldmatrix rather than a byte load per element.
The cache block size is a compile-time constant (a position's block and offset are a shift and a
mask, not an integer division per row and register layout), and the 2-byte scale gathers run one
tile ahead of their use from block ids loaded one tile earlier still; by default (`ids_ahead`) the
payload loads take their block ids from that run-ahead load too, so each tile waits on one
global-memory round trip, not two. The loop is latency-bound (by our count; measured:
docs/kv_quantization.md#measurements), so the default launch buys bytes per iteration (tiles of 128
positions) and programs per SM (a register cap for 8-bit parts): see default_quant_decode_config.
Positions that a part's full-precision window holds (sinks and the most recent tokens,
kvserve.kvstore) are not in the quantized loop: each split runs its quantized positions,
then the ring positions that fall in it, read exactly from the ring (or the plain cache of a
full-precision part).

Parts with dynamic scales (both 8-bit with per-token scales, or both int4) on NVIDIA GPUs go to
the pipelined Gluon kernel of decode_attention_quant_pipelined.py instead, by default
(`implementation`, quant_decode_kernel); this module still chooses its split count and combines
its partial outputs. With a window, the pipelined splits skip the ring's positions and the fast
kernel runs only those (RING_ONLY: one split over the whole context) into one more workspace slot,
which the combine kernel merges too (EXTRA_SPLIT). On sm_90 that launch (OVERLAP) and the combine
use programmatic dependent launch: the ring's programs run beside the pipelined kernel's, and only
their exit waits for it (measured: docs/kv_quantization.md#kernels).

Generic kernel (`_decode_split_quant_generic_kernel`): any head_dim and group, dequantizes each
tile element by element in fp32 and overlays ring rows; used where the fast one does not apply.

Per-channel int4 keys (FORMAT 4, kvserve.kvstore.formats): a (scale, zero) pair per channel and
block, not per token, so no scale comes out of the dot; both kernels dequantize each key tile
(code * scale + zero, the pair rows of each position's block) into the query's dtype and run the
dots on it. The pipelined kernel does not take them.

Both are CUDA-graph safe like decode_attention.py: context lengths, block tables and sequence rows
are read on the device only.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.triton._common import SPLIT_DECODE_DYNAMIC_ARGS, interpreting, next_power_of_2, pdl_enabled
from kvserve.kernels.triton.decode_attention import (COMBINE_SPLIT_CHUNK, LOG2_E, DecodeConfig,
                                                     _decode_combine_kernel, _resident_programs, _split_length,
                                                     choose_num_splits, decode_workspace, default_decode_config,
                                                     unused_partials)
from kvserve.kernels.triton.code_conversion import (BF16_QUERY_PRESCALE, E4M3_TO_F16_PTX, INT4_TO_F16_PTX,
                                                    INT8_TO_F16_PTX)
from kvserve.kernels.triton.decode_attention_quant_config import (TL_DTYPES, fast_config, fast_kernel_supported,
                                                                 fast_segments)
from kvserve.kernels.triton.kv_store_quant import CHANNEL_FORMAT, format_code



# --- fast kernel --------------------------------------------------------------------------------
@triton.jit
def _codes_8bit(raw, FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr, ASM: tl.constexpr, PURE: tl.constexpr):
    """int8 / e4m3 bytes -> the exact code values in DOT_DTYPE (unscaled). PURE=False keeps the
    compiler from moving the conversion after the shared-memory staging of a dot operand (see
    _value_segment)."""
    if ASM:
        if FORMAT == 1:
            codes = tl.inline_asm_elementwise(INT8_TO_F16_PTX, "=r,=r,r", [raw], dtype=tl.float16,
                                              is_pure=PURE, pack=4)
        else:
            codes = tl.inline_asm_elementwise(E4M3_TO_F16_PTX, "=r,=r,r", [raw], dtype=tl.float16,
                                              is_pure=PURE, pack=4)
    else:
        if FORMAT == 1:
            codes = raw.to(DOT_DTYPE)
        else:
            codes = raw.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
    return codes


@triton.jit
def _codes_int4(raw, DOT_DTYPE: tl.constexpr, ASM: tl.constexpr, PURE: tl.constexpr):
    """int4 bytes -> (low-nibble codes, high-nibble codes) in DOT_DTYPE."""
    if ASM:
        low, high = tl.inline_asm_elementwise(INT4_TO_F16_PTX, "=r,=r,=r,=r,r", [raw],
                                              dtype=(tl.float16, tl.float16), is_pure=PURE, pack=4)
    else:
        low = ((raw & 0xF).to(tl.int8) - 8).to(DOT_DTYPE)
        high = ((raw >> 4).to(tl.int8) - 8).to(DOT_DTYPE)
    return low, high


@triton.jit
def _segment_scales(scales_ptr, scale_rows, valid, NSEG: tl.constexpr, SEG: tl.constexpr, GROUP: tl.constexpr,
                    SCALED: tl.constexpr, TILE: tl.constexpr):
    """fp16 [TILE] scale of each (up to 4) segment of a tile's tokens (0 past the valid positions;
    entries past NSEG, or without dynamic scales, are placeholders)."""
    if SCALED:
        s0 = tl.load(scales_ptr + scale_rows, mask=valid, other=0.0)
        s1 = s0
        s2 = s0
        s3 = s0
        if NSEG > 1:
            if SEG // GROUP != 0:                    # int4 with one scale per head: both halves share it
                s1 = tl.load(scales_ptr + scale_rows + SEG // GROUP, mask=valid, other=0.0)
        if NSEG > 2:
            s2 = tl.load(scales_ptr + scale_rows + 2 * SEG // GROUP, mask=valid, other=0.0)
            s3 = tl.load(scales_ptr + scale_rows + 3 * SEG // GROUP, mask=valid, other=0.0)
    else:
        s0 = tl.zeros([TILE], tl.float16)
        s1 = s0
        s2 = s0
        s3 = s0
    return s0, s1, s2, s3


@triton.jit
def _query_segment(q_rows, group_mask, static_ptr, kv_head, SEGMENT: tl.constexpr, SEG: tl.constexpr,
                   HEAD_DIM: tl.constexpr, STATIC: tl.constexpr, PRESCALE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The group's queries over one segment's columns [GROUP_PAD, SEG] in DOT_DTYPE, times the static
    per-channel key scales when the keys have them."""
    cols = SEGMENT * SEG + tl.arange(0, SEG)
    q = tl.load(q_rows[:, None] + cols[None, :], mask=group_mask[:, None], other=0.0).to(tl.float32)
    if STATIC:
        q = q * tl.load(static_ptr + kv_head * HEAD_DIM + cols)[None, :]
    return (q * PRESCALE).to(DOT_DTYPE)


@triton.jit
def _load_chunks(ptr, rows, valid, FORMAT: tl.constexpr, NSEG: tl.constexpr, SEG: tl.constexpr):
    """A tile's payload bytes of one part as up to 4 chunks of SEG columns: the segments of a plain
    or 8-bit part; for int4, whose bytes hold segments c and c + NSEG/2, NSEG/2 chunks (entries past
    the chunk count repeat the first, unused). Masked positions read 0 (for int4 codes -8: their
    scores become -inf, their probabilities and scales 0; any other fill value would cost a select
    per byte)."""
    NCHUNK: tl.constexpr = NSEG // 2 if FORMAT >= 3 else NSEG
    cols = tl.arange(0, SEG)
    r0 = tl.load(ptr + rows[:, None] + cols[None, :], mask=valid[:, None], other=0)
    r1 = r0
    r2 = r0
    r3 = r0
    if NCHUNK > 1:
        r1 = tl.load(ptr + rows[:, None] + (SEG + cols)[None, :], mask=valid[:, None], other=0)
    if NCHUNK > 2:
        r2 = tl.load(ptr + rows[:, None] + (2 * SEG + cols)[None, :], mask=valid[:, None], other=0)
        r3 = tl.load(ptr + rows[:, None] + (3 * SEG + cols)[None, :], mask=valid[:, None], other=0)
    return r0, r1, r2, r3


@triton.jit
def _key_segment(q_seg, raw, scale, FORMAT: tl.constexpr, SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 ASM: tl.constexpr, PRECISION: tl.constexpr):
    """[GROUP_PAD, TILE] scores of one segment of plain or 8-bit keys (its raw [TILE, SEG] bytes)."""
    if FORMAT == 0:
        keys = raw.to(DOT_DTYPE)
    else:
        keys = _codes_8bit(raw, FORMAT, DOT_DTYPE, ASM, True)
    part = tl.dot(q_seg, tl.trans(keys), input_precision=PRECISION)
    if SCALED:
        part = part * scale.to(tl.float32)[None, :]
    return part


@triton.jit
def _key_int4_chunk(q_low, q_high, raw, low_scale, high_scale, CHUNK: tl.constexpr,
                    SEG: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SCALED: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, ASM: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of one chunk of int4 key bytes: its low nibbles are segment CHUNK, its high nibbles the
    segment head_dim/2 further."""
    low, high = _codes_int4(raw, DOT_DTYPE, ASM, True)
    LOW_GROUP: tl.constexpr = CHUNK * SEG // GROUP
    HIGH_GROUP: tl.constexpr = (HEAD_DIM // 2 + CHUNK * SEG) // GROUP
    if SCALED and LOW_GROUP != HIGH_GROUP:
        part = tl.dot(q_low, tl.trans(low), input_precision=PRECISION) * low_scale.to(tl.float32)[None, :]
        part += tl.dot(q_high, tl.trans(high), input_precision=PRECISION) * high_scale.to(tl.float32)[None, :]
    else:
        part = tl.dot(q_low, tl.trans(low), input_precision=PRECISION)
        part = tl.dot(q_high, tl.trans(high), acc=part, input_precision=PRECISION)
        if SCALED:
            part = part * low_scale.to(tl.float32)[None, :]
    return part


@triton.jit
def _key_scores(q0, q1, q2, q3, r0, r1, r2, r3, s0, s1, s2, s3, FORMAT: tl.constexpr,
                NSEG: tl.constexpr, SEG: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr, ASM: tl.constexpr, PRECISION: tl.constexpr):
    """[GROUP_PAD, TILE] raw scores (q . k) of a tile from its key chunks (_load_chunks)."""
    if FORMAT == 3:
        if NSEG == 2:
            scores = _key_int4_chunk(q0, q1, r0, s0, s1, 0, SEG, GROUP, HEAD_DIM, SCALED, DOT_DTYPE, ASM, PRECISION)
        else:
            scores = _key_int4_chunk(q0, q2, r0, s0, s2, 0, SEG, GROUP, HEAD_DIM, SCALED, DOT_DTYPE, ASM, PRECISION)
            scores += _key_int4_chunk(q1, q3, r1, s1, s3, 1, SEG, GROUP, HEAD_DIM, SCALED, DOT_DTYPE, ASM,
                                      PRECISION)
    else:
        scores = _key_segment(q0, r0, s0, FORMAT, SCALED, DOT_DTYPE, ASM, PRECISION)
        if NSEG > 1:
            scores += _key_segment(q1, r1, s1, FORMAT, SCALED, DOT_DTYPE, ASM, PRECISION)
        if NSEG > 2:
            scores += _key_segment(q2, r2, s2, FORMAT, SCALED, DOT_DTYPE, ASM, PRECISION)
            scores += _key_segment(q3, r3, s3, FORMAT, SCALED, DOT_DTYPE, ASM, PRECISION)
    return scores


@triton.jit
def _key_channel_scores(q_low, q_high, raw, scales_ptr, pair_rows, pair_stride, valid, SEG: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """[GROUP_PAD, TILE] scores of per-channel int4 keys (raw [TILE, head_dim/2] bytes): each half's
    codes times its block's channel scales plus zeros (pair_rows: each position's block and KV head
    row of the scales; pair_stride: scale row -> zero row), in DOT_DTYPE, one dot per half."""
    cols = tl.arange(0, SEG)[None, :]
    base = scales_ptr + pair_rows[:, None]
    rows_valid = valid[:, None]
    s_low = tl.load(base + cols, mask=rows_valid, other=0.0).to(tl.float32)
    s_high = tl.load(base + SEG + cols, mask=rows_valid, other=0.0).to(tl.float32)
    z_low = tl.load(base + pair_stride + cols, mask=rows_valid, other=0.0).to(tl.float32)
    z_high = tl.load(base + pair_stride + SEG + cols, mask=rows_valid, other=0.0).to(tl.float32)
    k_low = ((raw & 0xF).to(tl.float32) * s_low + z_low).to(DOT_DTYPE)
    k_high = ((raw >> 4).to(tl.float32) * s_high + z_high).to(DOT_DTYPE)
    part = tl.dot(q_low, tl.trans(k_low), input_precision=PRECISION)
    return tl.dot(q_high, tl.trans(k_high), acc=part, input_precision=PRECISION)


@triton.jit
def _weighted(probs, values, scale, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """sum_t probs[:, t] * scale[t] * values[t, :]: the scales, divided by the tile's largest, go on
    the probabilities (which stay in [0, 1] for fp16); the largest multiplies the result."""
    scale = scale.to(tl.float32)
    top = tl.max(scale, axis=0)
    weights = (probs * (scale / top)[None, :]).to(DOT_DTYPE)
    return tl.dot(weights, values, input_precision=PRECISION) * top


@triton.jit
def _value_segment(probs, raw, scale, FORMAT: tl.constexpr, SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   ASM: tl.constexpr, V_PURE: tl.constexpr, PRECISION: tl.constexpr):
    """[GROUP_PAD, SEG] P@V update of one segment of plain or 8-bit values.

    Values are the dot's B operand with the reduction running over tokens, which are not adjacent
    in memory: from 8-bit data in shared memory that costs a byte load per element. Converting the
    codes to fp16 first (V_PURE=False stops the compiler from moving the conversion past the
    staging) lets the 16-bit tile be read with transposing ldmatrix instead."""
    if FORMAT == 0:
        values = raw.to(DOT_DTYPE)
    else:
        values = _codes_8bit(raw, FORMAT, DOT_DTYPE, ASM, V_PURE)
    if SCALED:
        update = _weighted(probs, values, scale, DOT_DTYPE, PRECISION)
    else:
        update = tl.dot(probs.to(DOT_DTYPE), values, input_precision=PRECISION)
    return update


@triton.jit
def _value_int4_chunk(probs, raw, low_scale, high_scale, CHUNK: tl.constexpr, SEG: tl.constexpr,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      ASM: tl.constexpr, V_PURE: tl.constexpr, PRECISION: tl.constexpr):
    """(low segment update, high segment update) of one chunk of int4 value bytes."""
    low, high = _codes_int4(raw, DOT_DTYPE, ASM, V_PURE)
    LOW_GROUP: tl.constexpr = CHUNK * SEG // GROUP
    HIGH_GROUP: tl.constexpr = (HEAD_DIM // 2 + CHUNK * SEG) // GROUP
    if SCALED and LOW_GROUP == HIGH_GROUP:
        scale = low_scale.to(tl.float32)
        top = tl.max(scale, axis=0)
        weights = (probs * (scale / top)[None, :]).to(DOT_DTYPE)
        low_update = tl.dot(weights, low, input_precision=PRECISION) * top
        high_update = tl.dot(weights, high, input_precision=PRECISION) * top
    else:
        if SCALED:
            # Two scales per token: scaling the codes (a packed fp16 multiply per two elements,
            # before the staging) lets both dots share one probability operand.
            low = low * low_scale.to(DOT_DTYPE)[:, None]
            high = high * high_scale.to(DOT_DTYPE)[:, None]
        weights = probs.to(DOT_DTYPE)
        low_update = tl.dot(weights, low, input_precision=PRECISION)
        high_update = tl.dot(weights, high, input_precision=PRECISION)
    return low_update, high_update


@triton.jit
def _value_updates(probs, r0, r1, r2, r3, s0, s1, s2, s3, FORMAT: tl.constexpr, NSEG: tl.constexpr,
                   SEG: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SCALED: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, ASM: tl.constexpr, V_PURE: tl.constexpr, PRECISION: tl.constexpr):
    """Updates of the (up to 4) value segments from a tile's value chunks (_load_chunks); entries past
    NSEG repeat the first (unused)."""
    if FORMAT == 3:
        if NSEG == 2:
            u0, u1 = _value_int4_chunk(probs, r0, s0, s1, 0, SEG, GROUP, HEAD_DIM, SCALED, DOT_DTYPE, ASM, V_PURE,
                                       PRECISION)
            u2 = u0
            u3 = u0
        else:
            u0, u2 = _value_int4_chunk(probs, r0, s0, s2, 0, SEG, GROUP, HEAD_DIM, SCALED, DOT_DTYPE, ASM, V_PURE,
                                       PRECISION)
            u1, u3 = _value_int4_chunk(probs, r1, s1, s3, 1, SEG, GROUP, HEAD_DIM, SCALED, DOT_DTYPE, ASM, V_PURE,
                                       PRECISION)
    else:
        u0 = _value_segment(probs, r0, s0, FORMAT, SCALED, DOT_DTYPE, ASM, V_PURE, PRECISION)
        u1 = u0
        u2 = u0
        u3 = u0
        if NSEG > 1:
            u1 = _value_segment(probs, r1, s1, FORMAT, SCALED, DOT_DTYPE, ASM, V_PURE, PRECISION)
        if NSEG > 2:
            u2 = _value_segment(probs, r2, s2, FORMAT, SCALED, DOT_DTYPE, ASM, V_PURE, PRECISION)
            u3 = _value_segment(probs, r3, s3, FORMAT, SCALED, DOT_DTYPE, ASM, V_PURE, PRECISION)
    return u0, u1, u2, u3


@triton.jit
def _exact_value_segment(probs, ptr, rows, valid, SEGMENT: tl.constexpr, SEG: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    cols = SEGMENT * SEG + tl.arange(0, SEG)
    values = tl.load(ptr + rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
    return tl.dot(probs.to(DOT_DTYPE), values, input_precision=PRECISION)


@triton.jit
def _static_segment(static_ptr, kv_head, SEGMENT: tl.constexpr, SEG: tl.constexpr, HEAD_DIM: tl.constexpr,
                    STATIC: tl.constexpr):
    """[1, SEG] static per-channel value scales of a segment (ones without static scales)."""
    cols = SEGMENT * SEG + tl.arange(0, SEG)
    if STATIC:
        scale = tl.load(static_ptr + kv_head * HEAD_DIM + cols)[None, :]
    else:
        scale = tl.full([1, SEG], 1.0, tl.float32)
    return scale


@triton.jit
def _store_segment(acc, safe_sum, seq, heads, group_mask, split, out_ptr, partial_out_ptr, write_final,
                   out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head, partial_stride_split,
                   SEGMENT: tl.constexpr, SEG: tl.constexpr):
    cols = SEGMENT * SEG + tl.arange(0, SEG)
    result = acc / safe_sum[:, None]
    if write_final != 0:
        tl.store(out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + cols[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=group_mask[:, None])
    else:
        tl.store(partial_out_ptr + seq * partial_stride_seq + heads[:, None] * partial_stride_head
                 + split * partial_stride_split + cols[None, :], result, mask=group_mask[:, None])


@triton.jit(do_not_specialize=SPLIT_DECODE_DYNAMIC_ARGS)
def _decode_split_quant_kernel(
        query_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, k_static_ptr, v_static_ptr, k_ring_ptr, v_ring_ptr,
        seq_rows_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, partial_out_ptr, partial_lse_ptr,
        scale_log2, key_scale_log2, num_splits, block_size, write_final,
        query_stride_seq, query_stride_head,
        out_stride_seq, out_stride_head,
        block_table_stride_seq,
        k_stride_block, k_stride_token, k_stride_head, v_stride_block, v_stride_token, v_stride_head,
        ks_stride_block, ks_stride_token, ks_stride_head, vs_stride_block, vs_stride_token, vs_stride_head,
        ring_stride_token, ring_stride_head,
        partial_stride_seq, partial_stride_head, partial_stride_split,
        lse_stride_seq, lse_stride_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        TILE: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr,
        K_FORMAT: tl.constexpr, V_FORMAT: tl.constexpr, K_NSEG: tl.constexpr, V_NSEG: tl.constexpr,
        K_SEG: tl.constexpr, V_SEG: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
        K_SCALED: tl.constexpr, V_SCALED: tl.constexpr, K_STATIC: tl.constexpr, V_STATIC: tl.constexpr,
        K_RING: tl.constexpr, V_RING: tl.constexpr, SINKS: tl.constexpr, WINDOW: tl.constexpr,
        K_DOT: tl.constexpr, V_DOT: tl.constexpr, EXACT_DOT: tl.constexpr, K_PRESCALE: tl.constexpr,
        K_ASM: tl.constexpr, V_ASM: tl.constexpr, V_PURE: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, IDS_AHEAD: tl.constexpr, RING_ONLY: tl.constexpr = False,
        OVERLAP: tl.constexpr = False):
    # RING_ONLY: only the ring's positions (sinks, window), for the pipelined kernel, which runs the
    # quantized ones (one split over the whole context, written as a partial).
    # OVERLAP: launched with programmatic dependent launch right after the pipelined kernel, whose
    # results it does not read, so it runs in the SMs that kernel leaves free; only its exit waits for
    # that grid, so that the combine after it (which waits for this grid) sees both partials.
    if OVERLAP:
        gdc_launch_dependents()
    # BLOCK_SIZE (the cache's, fixed for an engine) is a compile-time constant here: a position's
    # block and offset are then a shift and a mask, not an integer division per row and layout,
    # which dominated the loop's instructions. (`block_size`, the runtime twin, is unused.)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    split_len = _split_length(context_len, num_splits, TILE, MIN_SPLIT_TOKENS)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)
    if write_final == 0:
        if start >= context_len:
            if OVERLAP:
                gdc_wait()
            return
    RING: tl.constexpr = SINKS + WINDOW > 0
    seq_row = 0
    if RING:
        seq_row = tl.load(seq_rows_ptr + seq).to(tl.int64)

    groups = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + groups
    group_mask = groups < GROUP
    q_rows = query_ptr + seq * query_stride_seq + heads * query_stride_head
    q0 = _query_segment(q_rows, group_mask, k_static_ptr, kv_head, 0, K_SEG, HEAD_DIM, K_STATIC, K_PRESCALE, K_DOT)
    q1 = q0
    q2 = q0
    q3 = q0
    if K_NSEG > 1:
        q1 = _query_segment(q_rows, group_mask, k_static_ptr, kv_head, 1, K_SEG, HEAD_DIM, K_STATIC, K_PRESCALE,
                            K_DOT)
    if K_NSEG > 2:
        q2 = _query_segment(q_rows, group_mask, k_static_ptr, kv_head, 2, K_SEG, HEAD_DIM, K_STATIC, K_PRESCALE,
                            K_DOT)
        q3 = _query_segment(q_rows, group_mask, k_static_ptr, kv_head, 3, K_SEG, HEAD_DIM, K_STATIC, K_PRESCALE,
                            K_DOT)
    # Static per-channel value scales multiply each tile's update of the quantized positions.
    vs_static0 = _static_segment(v_static_ptr, kv_head, 0, V_SEG, HEAD_DIM, V_STATIC)
    vs_static1 = vs_static0
    vs_static2 = vs_static0
    vs_static3 = vs_static0
    if V_STATIC:
        if V_NSEG > 1:
            vs_static1 = _static_segment(v_static_ptr, kv_head, 1, V_SEG, HEAD_DIM, V_STATIC)
        if V_NSEG > 2:
            vs_static2 = _static_segment(v_static_ptr, kv_head, 2, V_SEG, HEAD_DIM, V_STATIC)
            vs_static3 = _static_segment(v_static_ptr, kv_head, 3, V_SEG, HEAD_DIM, V_STATIC)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc0 = tl.zeros([GROUP_PAD, V_SEG], tl.float32)
    acc1 = tl.zeros([GROUP_PAD, V_SEG], tl.float32)
    acc2 = tl.zeros([GROUP_PAD, V_SEG], tl.float32)
    acc3 = tl.zeros([GROUP_PAD, V_SEG], tl.float32)
    table_row = block_tables_ptr + seq * block_table_stride_seq

    # Quantized positions of this split: past the sinks, before the window.
    quant_start = start
    quant_end = end
    ring_from = context_len
    if RING:
        ring_from = tl.maximum(context_len - WINDOW, SINKS)
        quant_start = tl.maximum(start, SINKS)
        quant_end = tl.minimum(end, ring_from)
        if RING_ONLY:
            quant_end = quant_start
    # Block ids run ahead of their use. Scales are 2-byte gathers the compiler does not pipeline;
    # loaded in the iteration that uses them they would wait on a global-memory round trip each tile
    # (after the block ids'). Each iteration loads the next tile's scales from block ids it loaded
    # one iteration earlier (scale_blocks: the next tile's; scale_blocks_after: the one after).
    # IDS_AHEAD: the tile's own block ids come from that run-ahead load too, so its payload loads
    # wait on one global-memory round trip, not two. (The compiler's cp.async pipeline then leaves
    # these loads alone; with in-loop block ids it takes them, but in Triton 3.6 with two stages it
    # issues the next tile's copies at the end of the loop body, behind that tile's block-id load,
    # and waits for them at the top of the next iteration: no overlap within a program either.)
    lanes = tl.arange(0, TILE)
    ahead = quant_start + lanes
    scale_blocks = tl.load(table_row + ahead // BLOCK_SIZE, mask=ahead < quant_end, other=0)
    ks_rows = scale_blocks.to(tl.int64) * ks_stride_block + ((ahead % BLOCK_SIZE) * ks_stride_token
                                                             + kv_head * ks_stride_head)
    ks0, ks1, ks2, ks3 = _segment_scales(k_scales_ptr, ks_rows, ahead < quant_end, K_NSEG, K_SEG, K_GROUP, K_SCALED,
                                         TILE)
    vs_rows = scale_blocks.to(tl.int64) * vs_stride_block + ((ahead % BLOCK_SIZE) * vs_stride_token
                                                             + kv_head * vs_stride_head)
    vs0, vs1, vs2, vs3 = _segment_scales(v_scales_ptr, vs_rows, ahead < quant_end, V_NSEG, V_SEG, V_GROUP, V_SCALED,
                                         TILE)
    current_blocks = scale_blocks
    ahead = ahead + TILE
    scale_blocks = tl.load(table_row + ahead // BLOCK_SIZE, mask=ahead < quant_end, other=0)
    for tile_start in range(quant_start, quant_end, TILE):
        positions = tile_start + lanes
        valid = positions < quant_end
        if K_SCALED or V_SCALED or IDS_AHEAD:
            ahead = positions + 2 * TILE
            scale_blocks_after = tl.load(table_row + ahead // BLOCK_SIZE, mask=ahead < quant_end, other=0)
            ahead = positions + TILE
            next_blocks = scale_blocks.to(tl.int64)
            next_offsets = ahead % BLOCK_SIZE
        if IDS_AHEAD:
            blocks = current_blocks.to(tl.int64)
        else:
            blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offsets = positions % BLOCK_SIZE
        k_rows = blocks * k_stride_block + (offsets * k_stride_token + kv_head * k_stride_head)
        kr0, kr1, kr2, kr3 = _load_chunks(k_ptr, k_rows, valid, K_FORMAT, K_NSEG, K_SEG)
        v_rows = blocks * v_stride_block + (offsets * v_stride_token + kv_head * v_stride_head)
        vr0, vr1, vr2, vr3 = _load_chunks(v_ptr, v_rows, valid, V_FORMAT, V_NSEG, V_SEG)
        if K_SCALED:
            ks_rows = next_blocks * ks_stride_block + (next_offsets * ks_stride_token + kv_head * ks_stride_head)
            nks0, nks1, nks2, nks3 = _segment_scales(k_scales_ptr, ks_rows, ahead < quant_end, K_NSEG, K_SEG, K_GROUP,
                                                     K_SCALED, TILE)
        if V_SCALED:
            vs_rows = next_blocks * vs_stride_block + (next_offsets * vs_stride_token + kv_head * vs_stride_head)
            nvs0, nvs1, nvs2, nvs3 = _segment_scales(v_scales_ptr, vs_rows, ahead < quant_end, V_NSEG, V_SEG, V_GROUP,
                                                     V_SCALED, TILE)

        if K_FORMAT == 4:
            # Per-channel keys: ks_stride_token is the scales' scale-row -> zero-row stride (_part_args).
            scores = _key_channel_scores(q0, q1, kr0, k_scales_ptr, blocks * ks_stride_block + kv_head * ks_stride_head,
                                         ks_stride_token, valid, K_SEG, K_DOT, PRECISION)
        else:
            scores = _key_scores(q0, q1, q2, q3, kr0, kr1, kr2, kr3, ks0, ks1, ks2, ks3, K_FORMAT, K_NSEG, K_SEG,
                                 K_GROUP, HEAD_DIM, K_SCALED, K_DOT, K_ASM, PRECISION)
        scores = tl.where(valid[None, :], scores * key_scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        running_max = new_max
        u0, u1, u2, u3 = _value_updates(probs, vr0, vr1, vr2, vr3, vs0, vs1, vs2, vs3, V_FORMAT, V_NSEG, V_SEG,
                                        V_GROUP, HEAD_DIM, V_SCALED, V_DOT, V_ASM, V_PURE, PRECISION)
        if V_STATIC:
            u0 = u0 * vs_static0
            u1 = u1 * vs_static1
            u2 = u2 * vs_static2
            u3 = u3 * vs_static3
        acc0 = acc0 * rescale[:, None] + u0
        if V_NSEG > 1:
            acc1 = acc1 * rescale[:, None] + u1
        if V_NSEG > 2:
            acc2 = acc2 * rescale[:, None] + u2
            acc3 = acc3 * rescale[:, None] + u3

        if IDS_AHEAD:
            current_blocks = scale_blocks
        if K_SCALED or V_SCALED or IDS_AHEAD:
            scale_blocks = scale_blocks_after
        if K_SCALED:
            ks0 = nks0
            ks1 = nks1
            ks2 = nks2
            ks3 = nks3
        if V_SCALED:
            vs0 = nvs0
            vs1 = nvs1
            vs2 = nvs2
            vs3 = nvs3

    if RING:
        # Positions of this split that the ring holds: sinks [start, min(end, SINKS)), then the
        # window [max(start, ring_from), end); read exactly (the ring, or a plain part's cache).
        num_sinks = tl.maximum(tl.minimum(end, SINKS) - start, 0)
        window_start = tl.maximum(start, ring_from)
        num_exact = num_sinks + tl.maximum(end - window_start, 0)
        dims = tl.arange(0, HEAD_DIM)
        q_exact = tl.load(q_rows[:, None] + dims[None, :], mask=group_mask[:, None], other=0.0).to(EXACT_DOT)
        for index_start in range(0, num_exact, TILE):
            index = index_start + tl.arange(0, TILE)
            valid = index < num_exact
            positions = tl.where(index < num_sinks, start + index, window_start + index - num_sinks)
            ring_index = positions
            if WINDOW > 0:
                ring_index = tl.where(positions < SINKS, positions, SINKS + positions % WINDOW)
            ring_rows = (seq_row * (SINKS + WINDOW) + ring_index).to(tl.int64) * ring_stride_token \
                + kv_head * ring_stride_head
            blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            offsets = (positions % BLOCK_SIZE).to(tl.int64)
            if K_RING:
                keys = tl.load(k_ring_ptr + ring_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            else:
                k_rows = blocks * k_stride_block + offsets * k_stride_token + kv_head * k_stride_head
                keys = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q_exact, tl.trans(keys.to(EXACT_DOT)), input_precision=PRECISION)
            scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp2(running_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            running_max = new_max
            if V_RING:
                v_exact_ptr = v_ring_ptr
                v_rows = ring_rows
            else:
                v_exact_ptr = v_ptr
                v_rows = blocks * v_stride_block + offsets * v_stride_token + kv_head * v_stride_head
            acc0 = acc0 * rescale[:, None] + _exact_value_segment(probs, v_exact_ptr, v_rows, valid, 0, V_SEG,
                                                                  EXACT_DOT, PRECISION)
            if V_NSEG > 1:
                acc1 = acc1 * rescale[:, None] + _exact_value_segment(probs, v_exact_ptr, v_rows, valid, 1, V_SEG,
                                                                      EXACT_DOT, PRECISION)
            if V_NSEG > 2:
                acc2 = acc2 * rescale[:, None] + _exact_value_segment(probs, v_exact_ptr, v_rows, valid, 2, V_SEG,
                                                                      EXACT_DOT, PRECISION)
                acc3 = acc3 * rescale[:, None] + _exact_value_segment(probs, v_exact_ptr, v_rows, valid, 3, V_SEG,
                                                                      EXACT_DOT, PRECISION)

    # A row that saw no position (only for context_len == 0) has sum 0 and acc 0 -> 0.
    safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
    _store_segment(acc0, safe_sum, seq, heads, group_mask, split, out_ptr, partial_out_ptr, write_final,
                   out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head, partial_stride_split,
                   0, V_SEG)
    if V_NSEG > 1:
        _store_segment(acc1, safe_sum, seq, heads, group_mask, split, out_ptr, partial_out_ptr, write_final,
                       out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head,
                       partial_stride_split, 1, V_SEG)
    if V_NSEG > 2:
        _store_segment(acc2, safe_sum, seq, heads, group_mask, split, out_ptr, partial_out_ptr, write_final,
                       out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head,
                       partial_stride_split, 2, V_SEG)
        _store_segment(acc3, safe_sum, seq, heads, group_mask, split, out_ptr, partial_out_ptr, write_final,
                       out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head,
                       partial_stride_split, 3, V_SEG)
    if write_final == 0:
        tl.store(partial_lse_ptr + seq * lse_stride_seq + heads * lse_stride_head + split,
                 running_max + tl.log2(safe_sum), mask=group_mask)
    if OVERLAP:
        gdc_wait()


# --- generic kernel -----------------------------------------------------------------------------
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
    if FORMAT == 4:
        values = _load_channel_part(ptr, scales_ptr, rows, blocks, valid, dims, mask, kv_head, scales_stride_block,
                                    scales_stride_token, scales_stride_head, HEAD_DIM, OUT_DTYPE, TILE, FAST)
    else:
        values = _load_token_part(ptr, scales_ptr, static_ptr, rows, blocks, offsets, valid, dims, dim_mask, mask,
                                  kv_head, scales_stride_block, scales_stride_token, scales_stride_head, FORMAT, GROUP,
                                  STATIC, HEAD_DIM, OUT_DTYPE, TILE, FAST)
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


@triton.jit
def _load_channel_part(ptr, scales_ptr, rows, blocks, valid, dims, mask, kv_head, scales_stride_block,
                       scales_stride_pair, scales_stride_head, HEAD_DIM: tl.constexpr, OUT_DTYPE: tl.constexpr,
                       TILE: tl.constexpr, FAST: tl.constexpr):
    """Per-channel int4 (codes 0..15): code * scale + zero, the pair of each position's block."""
    HALF: tl.constexpr = HEAD_DIM // 2
    if FAST:
        halves = tl.arange(0, HALF)
        byte = tl.load(ptr + rows[:, None] + halves[None, :], mask=valid[:, None], other=0)
        low = (byte & 0xF).to(tl.float32)
        high = (byte >> 4).to(tl.float32)
        codes = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (TILE, HEAD_DIM))
    else:
        byte = tl.load(ptr + rows[:, None] + (dims % HALF)[None, :], mask=mask, other=0)
        shift = tl.where(dims >= HALF, 4, 0).to(tl.uint8)
        codes = ((byte >> shift[None, :]) & 0xF).to(tl.float32)
    pair_rows = blocks * scales_stride_block + kv_head * scales_stride_head
    scale = tl.load(scales_ptr + pair_rows[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(scales_ptr + pair_rows[:, None] + scales_stride_pair + dims[None, :], mask=mask,
                   other=0.0).to(tl.float32)
    return (codes * scale + zero).to(OUT_DTYPE)


@triton.jit
def _load_token_part(ptr, scales_ptr, static_ptr, rows, blocks, offsets, valid, dims, dim_mask, mask, kv_head,
                     scales_stride_block, scales_stride_token, scales_stride_head, FORMAT: tl.constexpr,
                     GROUP: tl.constexpr, STATIC: tl.constexpr, HEAD_DIM: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     TILE: tl.constexpr, FAST: tl.constexpr):
    """int8 / e4m3 / int4 with per-token (or static per-channel) scales."""
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
    return (codes * scale).to(OUT_DTYPE)


@triton.jit(do_not_specialize=SPLIT_DECODE_DYNAMIC_ARGS)
def _decode_split_quant_generic_kernel(
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



# --- host ---------------------------------------------------------------------------------------
_quant_resident_per_sm: dict[tuple, int] = {}
# The pipelined kernel's splits fill 2 programs per SM even where 3 fit: on an H200 3 were slower in
# every sweep (measured: docs/kv_quantization.md#measurements).
PIPELINED_SPLIT_RESIDENT = 2


def _part_args(cache, placeholder: torch.Tensor):
    """(payload, scales, static, ring, strides, scale strides, FORMAT, GROUP, STATIC, RING) of a part."""
    if isinstance(cache, torch.Tensor):
        return (cache, placeholder, placeholder, placeholder, cache.stride()[:3], (0, 0, 0), 0, 1, False, False)
    fmt, head_dim = cache.fmt, cache.head_dim
    scales = cache.scales if cache.scales is not None else placeholder
    scale_strides = cache.scales.stride()[:3] if cache.scales is not None else (0, 0, 0)
    if fmt.per_channel:
        # [num_blocks, kv_heads, 2, head_dim]: (block, scale row -> zero row, head) in the kernels'
        # (block, token, head) stride slots.
        scale_strides = (cache.scales.stride(0), cache.scales.stride(2), cache.scales.stride(1))
    static = cache.static_scale if cache.static_scale is not None else placeholder
    ring = cache.window if cache.window is not None else placeholder
    return (cache.payload, scales, static, ring, cache.payload.stride()[:3], scale_strides,
            format_code(fmt), fmt.group(head_dim), fmt.static_scales, cache.window is not None)


def _part_signature(cache) -> tuple:
    if isinstance(cache, torch.Tensor):
        return ("plain", cache.dtype)
    return (cache.fmt, cache.window is not None)


def _occupancy_key(query: torch.Tensor, k_cache, v_cache, config: DecodeConfig, kind: str, asm: bool,
                   value_staging: str = "fp16") -> tuple:
    num_heads, head_dim = query.shape[1:]
    return (query.device, query.dtype, _part_signature(k_cache), _part_signature(v_cache),
            num_heads // k_cache.shape[2], head_dim, config, kind, asm, value_staging)


def quant_decode_kernel(query: torch.Tensor, k_cache, v_cache, config: DecodeConfig | None = None,
                        implementation: str = "auto") -> str:
    """The kernel paged_decode_attention_quant runs for these arguments: "pipelined"
    (decode_attention_quant_pipelined: dynamic scales; by default where it
    applies and no launch config is forced), "fast" or "generic" (this module's)."""
    if implementation not in ("auto", "pipelined", "fast", "generic"):
        raise ValueError(f"implementation must be auto, pipelined, fast or generic, got {implementation!r}")
    if implementation == "generic":
        return "generic"
    if implementation in ("auto", "pipelined") and (config is None or implementation == "pipelined"):
        # Imported here: Gluon is experimental Triton, needed only for quantized caches on NVIDIA GPUs.
        from kvserve.kernels.triton.decode_attention_quant_pipelined import pipelined_supported
        if pipelined_supported(query, k_cache, v_cache):
            return "pipelined"
        if implementation == "pipelined":
            raise ValueError("the pipelined quantized decode kernel does not support these caches")
    supported = fast_kernel_supported(query, k_cache, v_cache, config)
    if implementation == "fast" and not supported:
        raise ValueError("the fast quantized decode kernel does not support these caches")
    return "fast" if supported else "generic"


def _launch_config(kind: str, query, k_cache, v_cache, config: DecodeConfig | None) -> DecodeConfig:
    if config is not None:
        return config
    if kind == "pipelined":
        from kvserve.kernels.triton.decode_attention_quant_pipelined import pipelined_config
        return pipelined_config(k_cache.shape[2], k_cache.fmt.name == "int4")
    if kind == "fast":
        return fast_config(query.shape[2], query.dtype, k_cache, v_cache)
    return default_decode_config(query.shape[2], query.dtype)


def _programs_per_sequence(kind: str, k_cache) -> int:
    """Programs per sequence and split: one per KV head, but the pipelined kernel may run 4 per program."""
    if kind == "pipelined":
        from kvserve.kernels.triton.decode_attention_quant_pipelined import pipelined_programs_per_sequence
        return pipelined_programs_per_sequence(k_cache.shape[2], k_cache.fmt.name == "int4")
    return k_cache.shape[2]


def _use_asm(query: torch.Tensor, asm: bool | None) -> bool:
    """Inline-PTX code conversion: NVIDIA GPUs only, for the fp16 dots of 16-bit queries."""
    ok = (not interpreting() and query.device.type == "cuda" and torch.version.hip is None
          and query.dtype in (torch.float16, torch.bfloat16))
    return ok if asm is None else (asm and ok)


def _part_asm(cache, query: torch.Tensor, use_asm: bool) -> bool:
    """Whether a part's codes go through inline PTX (e4m3's packed conversion needs sm_89+)."""
    if not use_asm or isinstance(cache, torch.Tensor):
        return False
    if cache.fmt.name == "fp8_e4m3":
        return torch.cuda.get_device_capability(query.device) >= (8, 9)
    return True


def decode_num_splits_quant(query: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                            max_context_len: int | None = None, config: DecodeConfig | None = None,
                            implementation: str = "auto", asm: bool | None = None,
                            value_staging: str = "fp16") -> int:
    """The split count paged_decode_attention_quant picks for these arguments (to size a workspace
    ahead of a CUDA-graph capture, say): from the compiled kernel's occupancy once it has run."""
    kind = quant_decode_kernel(query, k_cache, v_cache, config, implementation)
    config = _launch_config(kind, query, k_cache, v_cache, config)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * k_cache.shape[1]
    key = _occupancy_key(query, k_cache, v_cache, config, kind, _use_asm(query, asm) and kind == "fast",
                         value_staging)
    return choose_num_splits(query.shape[0], _programs_per_sequence(kind, k_cache), max_context_len, query.device,
                             config, _quant_resident_per_sm.get(key))


def measured_quant_occupancy() -> dict[str, int]:
    """Programs per SM of each quantized-decode kernel variant launched so far (benchmark reports)."""
    return {f"{key[1]}/{key[2]}/{key[3]}/group{key[4]}/d{key[5]}/{key[6]}/{key[7]}"
            f"{'/asm' if key[8] else ''}/{key[9]}": resident for key, resident in _quant_resident_per_sm.items()}


def paged_decode_attention_quant(query: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float, seq_rows: torch.Tensor | None = None, *,
                                 out: torch.Tensor | None = None, max_context_len: int | None = None,
                                 num_splits: int | None = None,
                                 workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                                 config: DecodeConfig | None = None, implementation: str = "auto",
                                 asm: bool | None = None, value_staging: str = "fp16") -> torch.Tensor:
    """decode_attention.paged_decode_attention over caches whose parts may be QuantizedKVCache;
    `seq_rows` [B] (each sequence's window row) is needed when a part keeps a window.

    implementation: "auto" (the fast kernel where it applies, else the generic one), "fast" or
    "generic"; asm: inline-PTX code conversion in the fast kernel (default: on NVIDIA GPUs);
    value_staging: "fp16" converts value codes before their shared-memory staging (transposing
    ldmatrix), "codes" lets the compiler stage the raw bytes (for measurements)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    kind = quant_decode_kernel(query, k_cache, v_cache, config, implementation)
    config = _launch_config(kind, query, k_cache, v_cache, config)
    fast = kind == "fast"
    use_asm = _use_asm(query, asm) and fast
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    if config.use_dot:
        group_pad = max(16, group_pad)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    key = _occupancy_key(query, k_cache, v_cache, config, kind, use_asm, value_staging)
    if num_splits is None:
        num_splits = choose_num_splits(batch, _programs_per_sequence(kind, k_cache), max_context_len, query.device,
                                       config, _quant_resident_per_sm.get(key))
    placeholder = query
    k_args, v_args = _part_args(k_cache, placeholder), _part_args(v_cache, placeholder)
    rings = [c for c in (k_cache, v_cache) if not isinstance(c, torch.Tensor) and c.window is not None]
    if rings and seq_rows is None:
        raise ValueError("a quantized part keeps a full-precision window: pass seq_rows")
    ring_strides = rings[0].window.stride()[:2] if rings else (0, 0)
    sinks, window = (rings[0].num_sinks, rings[0].window_size) if rings else (0, 0)
    ring_only = None
    if kind == "pipelined":
        if not rings:
            return _launch_pipelined_split(query, k_cache, v_cache, block_tables, context_lens, scale, out,
                                           num_splits, workspace, config, key)
        # A window: the pipelined kernel's splits skip the positions the ring holds, which one more
        # launch of the fast kernel runs exactly (RING_ONLY, one split over the whole context) into
        # the workspace's extra slot; the combine merges both.
        partial_out, partial_lse = _split_workspace(query, num_splits + 1, workspace)
        _launch_pipelined_split(query, k_cache, v_cache, block_tables, context_lens, scale, out, num_splits,
                                (partial_out, partial_lse), config, key, ring=(sinks, window))
        ring_only = (partial_out, partial_lse, num_splits, config)
        fast, config = True, fast_config(head_dim, query.dtype, k_cache, v_cache)
        use_asm = _use_asm(query, asm)
    interpret = interpreting()
    pdl = pdl_enabled(query.device)
    common = (query, k_args[0], v_args[0], k_args[1], v_args[1], k_args[2], v_args[2], k_args[3], v_args[3],
              seq_rows if seq_rows is not None else context_lens, block_tables, context_lens)
    strides = (*k_args[4], *v_args[4], *k_args[5], *v_args[5], *ring_strides)
    scale_log2 = float(scale) * LOG2_E
    dim_pad = max(16, next_power_of_2(head_dim))
    precision = "ieee" if (query.dtype == torch.float32 or interpret) else "tf32"
    if fast:
        k_seg, v_seg = fast_segments(k_cache, head_dim), fast_segments(v_cache, head_dim, keys=False)
        query_dtype = TL_DTYPES[query.dtype]
        wide = tl.float32 if interpret or query.dtype == torch.float32 else tl.float16

        def dot_dtype(part_layout):
            # Plain parts, and per-channel keys (dequantized in the kernel), dot in the query's dtype.
            exact = part_layout[0] in (0, CHANNEL_FORMAT)
            return (tl.float32 if interpret else query_dtype) if exact else wide

        k_dot, v_dot = dot_dtype(k_seg), dot_dtype(v_seg)
        prescale = BF16_QUERY_PRESCALE if (k_seg[0] != 0 and k_dot == tl.float16
                                           and query.dtype == torch.bfloat16) else 1.0
        kernel = _decode_split_quant_kernel
        scalars = (scale_log2, scale_log2 / prescale)
        meta = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, TILE=config.tile,
                    MIN_SPLIT_TOKENS=config.min_split_tokens,
                    K_FORMAT=k_seg[0], V_FORMAT=v_seg[0], K_NSEG=k_seg[1], V_NSEG=v_seg[1], K_SEG=k_seg[2],
                    V_SEG=v_seg[2], K_GROUP=k_seg[3], V_GROUP=v_seg[3], K_SCALED=k_seg[4], V_SCALED=v_seg[4],
                    K_STATIC=k_seg[5], V_STATIC=v_seg[5], K_RING=k_args[9], V_RING=v_args[9],
                    SINKS=sinks, WINDOW=window, K_DOT=k_dot, V_DOT=v_dot,
                    EXACT_DOT=tl.float32 if interpret else query_dtype, K_PRESCALE=prescale,
                    K_ASM=_part_asm(k_cache, query, use_asm), V_ASM=_part_asm(v_cache, query, use_asm),
                    V_PURE=value_staging != "fp16", BLOCK_SIZE=block_size, IDS_AHEAD=config.ids_ahead,
                    PRECISION="ieee" if (query.dtype == torch.float32 or interpret) else "tf32",
                    RING_ONLY=ring_only is not None, OVERLAP=ring_only is not None and pdl,
                    num_warps=config.num_warps, num_stages=config.num_stages)
        if config.max_registers:
            meta["maxnreg"] = config.max_registers
    else:
        kernel = _decode_split_quant_generic_kernel
        scalars = (scale_log2,)
        meta = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
                    TILE=config.tile, MIN_SPLIT_TOKENS=config.min_split_tokens,
                    USE_DOT=config.use_dot, DOT_UPCAST=interpret, DOT_PRECISION=precision,
                    K_FORMAT=k_args[6], V_FORMAT=v_args[6], K_GROUP=k_args[7], V_GROUP=v_args[7],
                    K_STATIC=k_args[8], V_STATIC=v_args[8], K_RING=k_args[9], V_RING=v_args[9],
                    SINKS=sinks, WINDOW=window, num_warps=config.num_warps, num_stages=config.num_stages)
    if ring_only is not None:
        partial_out, partial_lse, num_splits, split_config = ring_only
        ring_out, ring_lse = partial_out[:, :, num_splits:], partial_lse[:, :, num_splits:]
        kernel[(batch, num_kv_heads, 1)](
            *common, out, ring_out, ring_lse, *scalars, 1, block_size, 0,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            *strides, ring_out.stride(0), ring_out.stride(1), ring_out.stride(2),
            ring_lse.stride(0), ring_lse.stride(1), launch_pdl=pdl, **meta)
        _combine(partial_out, partial_lse, context_lens, out, num_splits, split_config, extra_split=True)
        return out
    if num_splits == 1:
        compiled = kernel[(batch, num_kv_heads, 1)](
            *common, out, unused_partials(out), unused_partials(out), *scalars, 1, block_size, 1,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            *strides, 0, 0, 0, 0, 0, **meta)
        _note_occupancy(key, compiled, query.device)
        return out
    partial_out, partial_lse = _split_workspace(query, num_splits, workspace)
    compiled = kernel[(batch, num_kv_heads, num_splits)](
        *common, out, partial_out, partial_lse, *scalars, num_splits, block_size, 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *strides, partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), **meta)
    _note_occupancy(key, compiled, query.device)
    _combine(partial_out, partial_lse, context_lens, out, num_splits, config)
    return out


def _split_workspace(query: torch.Tensor, num_splits: int,
                     workspace: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's partial-output buffers (checked against this launch), or new ones."""
    batch, num_heads, head_dim = query.shape
    if workspace is None:
        workspace = decode_workspace(batch, num_heads, head_dim, num_splits, query.device)
    partial_out, partial_lse = workspace
    if partial_out.shape[2] < num_splits or partial_lse.shape[2] < num_splits or partial_out.shape[0] < batch:
        raise ValueError("workspace does not fit this launch (see decode_workspace)")
    return partial_out, partial_lse


def _combine(partial_out: torch.Tensor, partial_lse: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
             num_splits: int, config: DecodeConfig, extra_split: bool = False) -> None:
    batch, num_heads, head_dim = out.shape
    dim_pad = max(16, next_power_of_2(head_dim))
    # Programmatic dependent launch: scheduled while the split kernel drains; waits for it first.
    pdl = pdl_enabled(out.device)
    _decode_combine_kernel[(batch, num_heads)](
        partial_out, partial_lse, context_lens, out, num_splits,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, TILE=config.tile,
        MIN_SPLIT_TOKENS=config.min_split_tokens, SPLIT_CHUNK=COMBINE_SPLIT_CHUNK, EXTRA_SPLIT=extra_split,
        PDL=pdl, num_warps=4, launch_pdl=pdl)


def _launch_pipelined_split(query, k_cache, v_cache, block_tables, context_lens, scale, out, num_splits, workspace,
                            config, key, ring: tuple[int, int] | None = None) -> torch.Tensor:
    """decode_attention_quant_pipelined's kernel with this module's split, workspace and combine.
    With `ring` (sinks, window) it only writes its splits' partials, over the quantized positions;
    the caller runs the ring's and combines."""
    from kvserve.kernels.triton.decode_attention_quant_pipelined import launch_pipelined
    grid = (query.shape[0], _programs_per_sequence("pipelined", k_cache), num_splits)
    scale_log2 = float(scale) * LOG2_E
    if num_splits == 1 and ring is None:
        compiled = launch_pipelined(grid, query, k_cache, v_cache, block_tables, context_lens, scale_log2, out,
                                    unused_partials(out), unused_partials(out), 1, 1, config, (0, 0, 0, 0, 0))
        _note_occupancy(key, compiled, query.device, PIPELINED_SPLIT_RESIDENT)
        return out
    partial_out, partial_lse = _split_workspace(query, num_splits, workspace)
    compiled = launch_pipelined(grid, query, k_cache, v_cache, block_tables, context_lens, scale_log2, out,
                                partial_out, partial_lse, num_splits, 0, config,
                                (*partial_out.stride()[:3], *partial_lse.stride()[:2]), ring or (0, 0))
    _note_occupancy(key, compiled, query.device, PIPELINED_SPLIT_RESIDENT)
    if ring is None:
        _combine(partial_out, partial_lse, context_lens, out, num_splits, config)
    return out


def _note_occupancy(key: tuple, compiled, device: torch.device, cap: int | None = None) -> None:
    """Programs per SM the split choice fills: the compiled kernel's occupancy, at most `cap`."""
    if key not in _quant_resident_per_sm:
        resident = _resident_programs(compiled, device)
        if resident is not None:
            _quant_resident_per_sm[key] = min(resident, cap) if cap else resident

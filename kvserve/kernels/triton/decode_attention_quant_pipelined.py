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
head_dim 64 or 128; a GQA group of at most 8; fp16/bf16 queries; and int4 keys per channel
(kvserve.kvstore.formats: a scale and zero per channel and block, the int4 default) next to int4
values per token, without a window, in blocks of 16 up to a warp's share of a tile.

Per-channel keys: q . (s * c + z) = (q * s) . c + q . z, with (s, z) the block's. Each block of a
warp's positions in the tile gets its own key dot, whose query operand is the query times the
block's scales and whose initial accumulator is q . z minus the codes' offset (dots with constant
operands, so no cross-lane sum); the blocks' scores are then one tile's (a renaming of registers).
The pairs ([kv_heads, 2, head_dim] per block) ride in the ring beside their tile's codes, and the
codes convert in dim order (one byte permute more), so the scales need no reordering.

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
nibbles of even/odd bytes). A group's scale reaches its dots through the probabilities (in fp16,
unnormalised), and the values' offset term through one more dot of those weights with a constant
operand. With the KV heads in fours, each of a program's 4 warps runs its own KV head
(HEAD_WARPS), so a position's 4 heads' rows, adjacent in the cache, are copied as one piece.
Measured on an H200 (32k context, batch 32; benchmarks/results/kernels/h200_kv_quant_attention_*.json):
see the README's table and docs/kv_quantization.md#measurements.
With programmatic dependent launch (PDL: _common.pdl_enabled) the kernel lets the launches after it
be scheduled from its start: the window's (decode_attention_quant, OVERLAP) runs beside it.
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

from kvserve.kernels.triton._common import SPLIT_DECODE_DYNAMIC_ARGS, cuda_capability, interpreting, pdl_enabled
from kvserve.kernels.triton.code_conversion import (BF16_QUERY_PRESCALE, E4M3_TO_F16_PTX, INT4_HIGH_OFFSET,
                                                    INT4_LOW_OFFSET, INT4_TO_OFFSET_F16_IN_ORDER_PTX,
                                                    INT4_TO_OFFSET_F16_PTX, INT8_TO_F16_PTX)
from kvserve.kernels.triton.decode_attention import DecodeConfig
from kvserve.kernels.triton.decode_attention_quant_config import fast_kernel_supported
from kvserve.kernels.triton.kv_store_quant import FORMAT_CODES, format_code

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
    def _tile_positions(tile_start, WARPS: gl.constexpr, SUB: gl.constexpr, HEAD_WARPS: gl.constexpr,
                        layout: gl.constexpr):
        """[WARPS, SUB] positions of a tile: warp w owns positions w*SUB .. w*SUB + SUB-1, or with
        HEAD_WARPS (each warp its own KV head) every warp the tile's SUB positions."""
        warps = gl.arange(0, WARPS, layout=gl.SliceLayout(1, layout))
        subs = gl.arange(0, SUB, layout=gl.SliceLayout(0, layout))
        return tile_start + warps[:, None] * (0 if HEAD_WARPS else SUB) + subs[None, :]

    @gluon.jit
    def _warp_heads(head0, WARPS: gl.constexpr, HEAD_WARPS: gl.constexpr, layout: gl.constexpr):
        """[WARPS, 1] KV head of each warp (in a 2-d layout): head0 + w with HEAD_WARPS, else head0."""
        warps = gl.arange(0, WARPS, layout=gl.SliceLayout(1, layout))
        return (head0 + warps * (1 if HEAD_WARPS else 0))[:, None]

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
    def _row_offsets(blocks, positions, stride_block, stride_token, head_offset, BLOCK_SIZE: gl.constexpr,
                     WIDE: gl.constexpr):
        """Element offsets of positions' rows (one KV head) in a paged tensor: 64-bit only where the
        tensor needs it (WIDE), since K and V (codes, or scales) share their strides, once for both."""
        if WIDE:
            base = blocks.to(gl.int64)
        else:
            base = blocks
        return base * stride_block + ((positions & (BLOCK_SIZE - 1)) * stride_token + head_offset)

    @gluon.jit
    def _issue_tile(k_ptr, v_ptr, k_buf, v_buf, blocks, positions, end, stride_block, stride_token, head_offset,
                    ROW_BYTES: gl.constexpr, BLOCK_SIZE: gl.constexpr, WIDE: gl.constexpr, copy: gl.constexpr):
        """Asynchronous copies of a tile's K and V codes ([WARPS, SUB] positions, ROW_BYTES each) into
        one ring slot (zeros past `end`)."""
        valid = (positions < end)[:, :, None]
        cols = gl.arange(0, ROW_BYTES, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy)))[None, None, :]
        rows = _row_offsets(blocks, positions, stride_block, stride_token, head_offset, BLOCK_SIZE, WIDE)[:, :, None]
        async_copy.async_copy_global_to_shared(k_buf, k_ptr + rows + cols, mask=valid)
        async_copy.async_copy_global_to_shared(v_buf, v_ptr + rows + cols, mask=valid)

    @gluon.jit
    def _group_scales(scales_ptr, rows, valid, NUM_GROUPS: gl.constexpr):
        """fp16 [WARPS, SUB] scales of each of a tile's (up to 4) scale groups at element offsets `rows`
        (0 where not `valid`; entries past NUM_GROUPS repeat the first). A position's 2 or 4 scales are
        adjacent (and aligned: pipelined_supported), so they come in one 4- or 8-byte load and are
        split in registers."""
        if NUM_GROUPS == 1:
            s0 = gl.load(scales_ptr + rows, mask=valid, other=0.0)
            s1 = s0
            s2 = s0
            s3 = s0
        elif NUM_GROUPS == 2:
            both = gl.load((scales_ptr + rows).to(gl.pointer_type(gl.int32), bitcast=True), mask=valid, other=0)
            s0 = both.to(gl.int16).to(gl.float16, bitcast=True)
            s1 = (both >> 16).to(gl.int16).to(gl.float16, bitcast=True)
            s2 = s0
            s3 = s0
        else:
            pairs = (scales_ptr + rows).to(gl.pointer_type(gl.int32), bitcast=True)
            lo = gl.load(pairs, mask=valid, other=0)
            hi = gl.load(pairs + 1, mask=valid, other=0)
            s0 = lo.to(gl.int16).to(gl.float16, bitcast=True)
            s1 = (lo >> 16).to(gl.int16).to(gl.float16, bitcast=True)
            s2 = hi.to(gl.int16).to(gl.float16, bitcast=True)
            s3 = (hi >> 16).to(gl.int16).to(gl.float16, bitcast=True)
        return s0, s1, s2, s3

    @gluon.jit
    def _tile_scales(k_scales_ptr, v_scales_ptr, blocks, positions, end, stride_block, stride_token, head_offset,
                     K_GROUPS: gl.constexpr, V_GROUPS: gl.constexpr, BLOCK_SIZE: gl.constexpr, WIDE: gl.constexpr,
                     KEY_TOKEN_SCALES: gl.constexpr = True):
        """A tile's key and value scales per group (_group_scales), from one row offset per position.
        Keys with per-channel pairs (not KEY_TOKEN_SCALES) have none: their entries repeat the values'."""
        rows = _row_offsets(blocks, positions, stride_block, stride_token, head_offset, BLOCK_SIZE, WIDE)
        valid = positions < end
        vs0, vs1, vs2, vs3 = _group_scales(v_scales_ptr, rows, valid, V_GROUPS)
        if KEY_TOKEN_SCALES:
            ks0, ks1, ks2, ks3 = _group_scales(k_scales_ptr, rows, valid, K_GROUPS)
        else:
            ks0, ks1, ks2, ks3 = vs0, vs0, vs0, vs0
        return ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3

    @gluon.jit
    def _query_chunk(q_base, query_stride_head, head0, DIM0: gl.constexpr, WIDTH: gl.constexpr,
                     GROUP: gl.constexpr, HEADS: gl.constexpr, WARPS: gl.constexpr, HEAD_WARPS: gl.constexpr,
                     PRESCALE: gl.constexpr, INT4: gl.constexpr, operand: gl.constexpr, sums: gl.constexpr):
        """(q^T [WIDTH, 8] of the group over dims DIM0 .. DIM0 + WIDTH (heads past GROUP are 0), times
        PRESCALE (a power of 2, so that any bf16 value fits fp16), per warp (its KV head's group); its fp32 sum
        over the dims, per head, in layout `sums`). For int4 keys the dims follow the converted codes'
        order (_int4_order)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8, 1], [1, 4, 8], [WARPS, 1, 1], [1, 2, 0])
        dims = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        if INT4:
            dims = _int4_order(dims)
        heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        kv_heads = _warp_heads(head0, WARPS, HEAD_WARPS, gl.SliceLayout(1, layout))
        head_rows = (kv_heads * GROUP + heads[None, :])[:, None, :]
        ptrs = q_base + head_rows * query_stride_head + (DIM0 + dims)[None, :, None]
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
    def _pair_positions(tile_start, BLOCKS: gl.constexpr, WARPS: gl.constexpr, SUB: gl.constexpr,
                        HEAD_WARPS: gl.constexpr, BLOCK_SIZE: gl.constexpr, layout: gl.constexpr):
        """[2 * BLOCKS * WARPS] first position of the block whose per-channel key (scale, zero) rows land in
        row (2j + part) * WARPS + w of a pair slot (part 0 scales, 1 zeros): block j of warp w's positions
        in the tile (_tile_positions)."""
        rows = gl.arange(0, 2 * BLOCKS * WARPS, layout=layout)
        return tile_start + (rows % WARPS) * (0 if HEAD_WARPS else SUB) + (rows // (2 * WARPS)) * BLOCK_SIZE

    @gluon.jit
    def _issue_pairs(pairs_ptr, pair_buf, blocks, positions, end, pair_stride_block, pair_stride_head, head0,
                     HEAD_DIM: gl.constexpr, WARPS: gl.constexpr, HEAD_WARPS: gl.constexpr, WIDE: gl.constexpr,
                     copy: gl.constexpr):
        """Asynchronous copies of a tile's per-channel key (scale, zero) rows ([kv_heads, 2, HEAD_DIM] per
        block: row 0 scales, row 1 zeros) into one pair slot [2 * blocks * WARPS, HEAD_DIM]
        (_pair_positions' rows)."""
        rows = gl.arange(0, positions.shape[0], layout=gl.SliceLayout(1, copy))
        heads = head0 + (rows % WARPS) * (1 if HEAD_WARPS else 0)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, copy))[None, :]
        if WIDE:
            base = blocks.to(gl.int64)
        else:
            base = blocks
        offsets = (base * pair_stride_block + heads * pair_stride_head + ((rows // WARPS) % 2) * HEAD_DIM)[:, None]
        async_copy.async_copy_global_to_shared(pair_buf, pairs_ptr + offsets + cols, mask=(positions < end)[:, None])

    @gluon.jit
    def _channel_block_scores(codes_buf, pairs, q_low, q_high, ones, minus_offsets, zero, J: gl.constexpr,
                              HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, WARPS: gl.constexpr,
                              k_operand: gl.constexpr, q_operand: gl.constexpr):
        """[WARPS, BLOCK_SIZE, 8] scores^T of block J of a tile whose int4 keys have a (scale, zero) pair per
        channel and block: q . (s * c + z) = (q * s) . c + q . z, so the block's scales multiply the query
        (the dot's other operand; codes and query in dim order) and the dot's initial accumulator is
        q . z minus the codes' offset (1024 times the scaled query's sum: unsigned codes convert as
        1024 + c, high nibbles as 1024 + 16 c, so `q_high` comes divided by 16). Both are dots with
        constant operands (`ones`, `minus_offsets` = -1024), which leaves them in the scores' layout
        with no cross-lane sum; the offset's products are exact, so it cancels to fp32 rounding."""
        HALF: gl.constexpr = HEAD_DIM // 2
        vec: gl.constexpr = gl.SliceLayout(2, q_operand)
        scales = pairs.slice(2 * J * WARPS, WARPS, dim=0)
        zeros = pairs.slice((2 * J + 1) * WARPS, WARPS, dim=0)
        b_low = q_low * scales.slice(0, HALF, dim=1).load(vec)[:, :, None]
        b_high = q_high * scales.slice(HALF, HALF, dim=1).load(vec)[:, :, None]
        q_zero = (q_low * zeros.slice(0, HALF, dim=1).load(vec)[:, :, None]
                  + q_high * (zeros.slice(HALF, HALF, dim=1).load(vec) * 16.0)[:, :, None])
        init = mma_v2(ones, q_zero, mma_v2(minus_offsets, b_high, mma_v2(minus_offsets, b_low, zero)))
        low, high = gl.inline_asm_elementwise(
            INT4_TO_OFFSET_F16_IN_ORDER_PTX, "=r,=r,=r,=r,r",
            [codes_buf.slice(J * BLOCK_SIZE, BLOCK_SIZE, dim=1).load(k_operand)], dtype=(gl.float16, gl.float16),
            is_pure=True, pack=4)
        return mma_v2(high, b_high, mma_v2(low, b_low, init))

    @gluon.jit
    def _join_blocks(s0, s1, s2, s3, BLOCKS: gl.constexpr, WARPS: gl.constexpr, SUB: gl.constexpr,
                     mma: gl.constexpr):
        """The [WARPS, SUB, 8] scores of a tile from its BLOCKS (1, 2 or 4) blocks' [WARPS, SUB / BLOCKS, 8]
        (block j's rows at j * SUB / BLOCKS): in the mma layout each is a repetition of the instruction
        tile, so this only renames registers."""
        if BLOCKS == 1:
            joined = s0
        elif BLOCKS == 2:
            joined = gl.reshape(gl.permute(gl.join(s0, s1), [0, 3, 1, 2]), [WARPS, SUB, 8])
        else:
            joined = gl.reshape(gl.permute(gl.join(gl.join(s0, s1), gl.join(s2, s3)), [0, 4, 3, 1, 2]),
                                [WARPS, SUB, 8])
        return gl.convert_layout(joined, mma)

    @gluon.jit
    def _chunk_update(v_stage, weights, top, v_operand: gl.constexpr, zero):
        """8-bit values: out^T [WARPS, HEAD_DIM, 8] update from the staged fp16 values."""
        values = v_stage.permute([0, 2, 1]).load(v_operand)
        return mma_v2(values, weights, zero) * top[:, None, None]

    @gluon.jit
    def _pair_slice_update(v_pairs, acc_low_even, acc_low_odd, acc_high_even, acc_high_odd, rescale,
                           low_weights, low_offsets, high_weights, high_offsets, SLICE: gl.constexpr,
                           v_operand: gl.constexpr):
        """int4 values, straight from the ring slot: code bytes 32*SLICE .. 32*SLICE + 31 of every position,
        read as 16-bit pairs by transposing loads (ldmatrix.trans), so a thread's 32-bit register holds
        one byte pair at two consecutive positions: exactly what one LOP3 per two values turns into the
        value dot's operand, (position p, p+1) of one dim (INT4_TO_OFFSET_F16_PTX). The four results
        are the low nibbles of the pairs' even and odd bytes (dims 32*SLICE + 2m and + 2m + 1) and the
        high nibbles (the same + HEAD_DIM/2), each updating its own [WARPS, 16, 8] accumulator, whose
        rescaled value plus the tile's offset term (-1032 or -1152 times the weights' sum,
        _value_weights) is the dot's initial accumulator: one FFMA per element besides the dot.
        High-nibble accumulators hold 16 x their values (divided out at the store)."""
        codes = v_pairs.slice(16 * SLICE, 16, dim=2).permute([0, 2, 1]).load(v_operand)
        low_even, low_odd, high_even, high_odd = gl.inline_asm_elementwise(
            INT4_TO_OFFSET_F16_PTX, "=r,=r,=r,=r,r", [codes], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True, pack=2)
        acc_low_even = mma_v2(low_even, low_weights, acc_low_even * rescale + low_offsets)
        acc_low_odd = mma_v2(low_odd, low_weights, acc_low_odd * rescale + low_offsets)
        acc_high_even = mma_v2(high_even, high_weights, acc_high_even * rescale + high_offsets)
        acc_high_odd = mma_v2(high_odd, high_weights, acc_high_odd * rescale + high_offsets)
        return acc_low_even, acc_low_odd, acc_high_even, acc_high_odd

    @gluon.jit
    def _value_weights(probs16, scales, p_operand: gl.constexpr):
        """int4 values: the probabilities times each position's value scale of one group, in fp16, as the
        value dot's operand. No normalisation: probabilities are at most 1 and scales fp16, so the
        product stays finite. Products under 2^-14 are fp16 subnormals, rounded with an absolute
        error of at most 2^-25 (normalised weights, as 8-bit values use, keep 11 significant bits)."""
        return gl.convert_layout(probs16 * scales[:, :, None], p_operand)

    @gluon.jit
    def _offset_terms(weights, offset_ones, zero):
        """[WARPS, 16, 8] tile of -offset times the weights' sum over the tile's positions (per warp and
        head, the same in every row), by a dot with a constant operand: it cancels the offset the
        value codes carry (INT4_TO_OFFSET_F16_PTX) without a cross-lane sum."""
        return mma_v2(offset_ones, weights, zero)

    @gluon.jit
    def _scaled_weights(probs, scales, p_operand: gl.constexpr):
        """8-bit values: (p * s / max s in fp16 as the dot's operand, max s) per warp: the probabilities
        times each position's value scale, divided by the warp's largest (so fp16 keeps them in [0, 1])."""
        value_scales = scales.to(gl.float32)
        top = gl.maximum(gl.max(value_scales, axis=1), 1e-30)
        weights = (probs * (value_scales / top[:, None])[:, :, None]).to(gl.float16)
        return gl.convert_layout(weights, p_operand), top

    @gluon.jit
    def _store_chunk(acc, factors, safe_sum, out_ptr, partial_out_ptr, seq, head0, split, write_final,
                     out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head, partial_stride_split,
                     DIM0: gl.constexpr, STEP: gl.constexpr, ROWS: gl.constexpr, GROUP: gl.constexpr,
                     HEADS: gl.constexpr, WARPS: gl.constexpr, HEAD_WARPS: gl.constexpr, mma: gl.constexpr):
        """Store one accumulator's ROWS dims, DIM0 + STEP * row, of the output (or of this split's
        partial output): each warp its own KV head's (HEAD_WARPS), else merged across warps."""
        if HEAD_WARPS:
            result = acc / safe_sum[:, None, :]
            groups = gl.arange(0, HEADS, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
            heads = (_warp_heads(head0, WARPS, True, gl.SliceLayout(1, mma)) * GROUP + groups[None, :])[:, None, :]
            dims = (DIM0 + STEP * gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma))))[None, :, None]
            group_mask = (groups < GROUP)[None, None, :]
        else:
            out_layout: gl.constexpr = gl.SliceLayout(0, mma)
            merged = gl.sum(acc * factors[:, None, :], axis=0)
            result = merged / gl.convert_layout(safe_sum, gl.SliceLayout(0, out_layout))[None, :]
            dims = (DIM0 + STEP * gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout)))[:, None]
            groups = gl.arange(0, HEADS, layout=gl.SliceLayout(0, out_layout))
            heads = (head0 * GROUP + groups)[None, :]
            group_mask = (groups < GROUP)[None, :]
        if write_final != 0:
            gl.store(out_ptr + seq * out_stride_seq + heads * out_stride_head + dims,
                     result.to(out_ptr.dtype.element_ty), mask=group_mask)
        else:
            gl.store(partial_out_ptr + seq * partial_stride_seq + heads * partial_stride_head
                     + split * partial_stride_split + dims, result, mask=group_mask)

    @gluon.jit(do_not_specialize=SPLIT_DECODE_DYNAMIC_ARGS)
    def _decode_split_pipelined_kernel(
            query_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, context_lens_ptr,
            out_ptr, partial_out_ptr, partial_lse_ptr,
            key_scale_log2, num_splits, write_final,
            query_stride_seq, query_stride_head, out_stride_seq, out_stride_head,
            block_table_stride_seq,
            stride_block, stride_token, stride_head, scale_stride_block, scale_stride_token, scale_stride_head,
            pair_stride_block, pair_stride_head,
            partial_stride_seq, partial_stride_head, partial_stride_split,
            lse_stride_seq, lse_stride_head,
            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, TILE: gl.constexpr, STAGES: gl.constexpr,
            MIN_SPLIT_TOKENS: gl.constexpr, K_FORMAT: gl.constexpr, V_FORMAT: gl.constexpr,
            K_GROUP: gl.constexpr, V_GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr, PRESCALE: gl.constexpr,
            SINKS: gl.constexpr, WINDOW: gl.constexpr, WIDE: gl.constexpr, HEAD_WARPS: gl.constexpr,
            PDL: gl.constexpr = False):
        if PDL:
            # Let the kernels after this one (the window's, the combine: launched with programmatic
            # dependent launch) be scheduled now; each waits for this grid where it needs its results
            # (_common.pdl_enabled). The window's then runs in the SMs this one leaves free.
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        WARPS: gl.constexpr = 4
        # HEAD_WARPS: warp w runs KV head 4 * program_id(1) + w over each tile's TILE positions, so the 4
        # heads' rows of a position (adjacent in the cache) are copied together. Else the program's one
        # KV head, warp w running positions w*SUB .. of each tile.
        SUB: gl.constexpr = TILE if HEAD_WARPS else TILE // WARPS
        LOG2_BLOCK: gl.constexpr = BLOCK_SIZE.bit_length() - 1
        HEADS: gl.constexpr = 8
        # Bytes per position and head: both parts 8-bit, or both int4 (two codes per byte: dims j and
        # HEAD_DIM/2 + j). int4 key dots go in chunks of K_CHUNK dims that share a scale; int4 values in
        # slices of 32 code bytes (one scale group for each nibble half: V_GROUP >= 32), one accumulator
        # per nibble half and byte parity, [WARPS, 16, 8] each.
        # CHANNEL: int4 keys with a (scale, zero) pair per channel and block (kv_store_quant.CHANNEL_FORMAT),
        # in k_scales_ptr as [blocks, kv_heads, 2, HEAD_DIM] (pair strides); values int4 per token.
        CHANNEL: gl.constexpr = K_FORMAT == 4
        INT4: gl.constexpr = K_FORMAT == 3 or CHANNEL
        # Blocks of a warp's positions in a tile (CHANNEL: each has its own pairs, so its own key dot).
        BLOCKS: gl.constexpr = SUB // BLOCK_SIZE if CHANNEL else 1
        HALF: gl.constexpr = HEAD_DIM // 2
        ROW_BYTES: gl.constexpr = HALF if INT4 else HEAD_DIM
        K_CHUNK: gl.constexpr = min(K_GROUP, ROW_BYTES) if INT4 else HEAD_DIM
        K_CHUNKS: gl.constexpr = HEAD_DIM // K_CHUNK
        SLICES: gl.constexpr = ROW_BYTES // 32
        ACC_ROWS: gl.constexpr = 16 if INT4 else HEAD_DIM
        # Every warp runs its own online softmax over its SUB positions of each tile (merged across warps
        # once, at the end, unless each warp has its own KV head), so the loop has no cross-warp
        # reduction. The dots are transposed (keys and values are the M side, the GQA group the N = 8
        # side of mma.m16n8k16): scores^T [SUB, 8] = K [SUB, D] q^T [D, 8] and out^T [D, 8] +=
        # V^T [D, SUB] p^T [SUB, 8], which wastes no rows on padding heads and keeps the accumulator
        # at [D, 8] per warp.
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        # Keys enter with 4 consecutive channels per 32-bit register (one shared-memory load of 4
        # codes, converted in place); the query operand's channel order matches.
        k_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        q_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
        v_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # Copies: 16 codes (16 bytes) per thread and row. Warp w copies its rows, or with HEAD_WARPS
        # (rows [head, position]) whole positions, all 4 heads' rows in one contiguous piece: a quarter of
        # the cache lines per instruction for int4's 64-byte rows (measured: docs/kv_quantization.md).
        CHUNKS: gl.constexpr = ROW_BYTES // 16
        if HEAD_WARPS:
            copy: gl.constexpr = gl.BlockedLayout([1, 1, 16], [WARPS, 32 // (WARPS * CHUNKS), CHUNKS], [1, WARPS, 1],
                                                  [2, 0, 1])
        else:
            copy: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32 // CHUNKS, CHUNKS], [WARPS, 1, 1], [2, 1, 0])
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
        head0 = gl.program_id(1) * (WARPS if HEAD_WARPS else 1)
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
        # Dims in the converted int4 codes' order, but per-channel keys convert in dim order.
        KEY_ORDER: gl.constexpr = INT4 and not CHANNEL
        q0, qs0 = _query_chunk(q_base, query_stride_head, head0, 0, K_CHUNK, GROUP, HEADS, WARPS, HEAD_WARPS,
                               PRESCALE, KEY_ORDER, q_operand, head_cols)
        q1, qs1 = q0, qs0
        q2, qs2 = q0, qs0
        q3, qs3 = q0, qs0
        if K_CHUNKS > 1:
            q1, qs1 = _query_chunk(q_base, query_stride_head, head0, K_CHUNK, K_CHUNK, GROUP, HEADS, WARPS,
                                   HEAD_WARPS, PRESCALE, KEY_ORDER, q_operand, head_cols)
        if K_CHUNKS > 2:
            q2, qs2 = _query_chunk(q_base, query_stride_head, head0, 2 * K_CHUNK, K_CHUNK, GROUP, HEADS, WARPS,
                                   HEAD_WARPS, PRESCALE, INT4, q_operand, head_cols)
            q3, qs3 = _query_chunk(q_base, query_stride_head, head0, 3 * K_CHUNK, K_CHUNK, GROUP, HEADS, WARPS,
                                   HEAD_WARPS, PRESCALE, INT4, q_operand, head_cols)
        if CHANNEL:
            q1 = q1 * 0.0625       # exact: the high nibbles' codes convert as 16 x code

        k_bufs = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [STAGES, WARPS, SUB, ROW_BYTES], codes_smem)
        v_bufs = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [STAGES, WARPS, SUB, ROW_BYTES], codes_smem)
        if not INT4:
            v_stage = gl.allocate_shared_memory(gl.float16, [WARPS, SUB, HEAD_DIM], values_smem)
        if CHANNEL:
            # Per-channel key pairs ride in the ring with their tile: 16-byte copies, HEAD_DIM // 8 lanes
            # along a row.
            pair_lanes: gl.constexpr = HEAD_DIM // 8
            pair_copy: gl.constexpr = gl.BlockedLayout([1, 8], [32 // pair_lanes, pair_lanes], [WARPS, 1], [1, 0])
            pair_rows: gl.constexpr = gl.SliceLayout(1, pair_copy)
            key_pairs_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
            pair_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, 2 * BLOCKS * WARPS, HEAD_DIM], key_pairs_smem)

        table_row = block_tables_ptr + seq * block_table_stride_seq
        # K and V share their strides (codes, and scales: launch_pipelined), so one offset serves both.
        head_offset = _warp_heads(head0, WARPS, HEAD_WARPS, rows) * stride_head
        scale_head_offset = _warp_heads(head0, WARPS, HEAD_WARPS, token_rows) * scale_stride_head
        K_GROUPS: gl.constexpr = HEAD_DIM // K_GROUP
        V_GROUPS: gl.constexpr = HEAD_DIM // V_GROUP

        # Prologue: tiles 0 .. STAGES-2 in flight, one commit group each.
        for s in gl.static_range(STAGES - 1):
            positions = _tile_positions(start + s * TILE, WARPS, SUB, HEAD_WARPS, rows)
            blocks = _block_ids(table_row, positions, end, LOG2_BLOCK)
            _issue_tile(k_ptr, v_ptr, k_bufs.index(s), v_bufs.index(s), blocks, positions, end, stride_block,
                        stride_token, head_offset, ROW_BYTES, BLOCK_SIZE, WIDE, copy)
            if CHANNEL:
                pair_starts = _pair_positions(start + s * TILE, BLOCKS, WARPS, SUB, HEAD_WARPS, BLOCK_SIZE, pair_rows)
                _issue_pairs(k_scales_ptr, pair_bufs.index(s), _block_ids(table_row, pair_starts, end, LOG2_BLOCK),
                             pair_starts, end, pair_stride_block, pair_stride_head, head0, HEAD_DIM, WARPS,
                             HEAD_WARPS, WIDE, pair_copy)
            async_copy.commit_group()
        first_ahead = _tile_positions(start + (STAGES - 1) * TILE, WARPS, SUB, HEAD_WARPS, rows)
        copy_blocks = _block_ids(table_row, first_ahead, end, LOG2_BLOCK)
        if CHANNEL:
            pair_ahead = _pair_positions(start + (STAGES - 1) * TILE, BLOCKS, WARPS, SUB, HEAD_WARPS, BLOCK_SIZE,
                                         pair_rows)
            pair_blocks = _block_ids(table_row, pair_ahead, end, LOG2_BLOCK)
        positions = _tile_positions(start, WARPS, SUB, HEAD_WARPS, token_rows)
        scale_blocks = _block_ids(table_row, positions, end, LOG2_BLOCK)
        ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3 = _tile_scales(
            k_scales_ptr, v_scales_ptr, scale_blocks, positions, end, scale_stride_block, scale_stride_token,
            scale_head_offset, K_GROUPS, V_GROUPS, BLOCK_SIZE, WIDE, not CHANNEL)
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
        acc_zero = gl.zeros([WARPS, ACC_ROWS, HEADS], gl.float32, layout=mma)
        if INT4:
            # Constant operands whose dot with a tile's value weights is -offset times their sum.
            low_ones = gl.full([WARPS, 16, SUB], -INT4_LOW_OFFSET, gl.float16, layout=v_operand)
            high_ones = gl.full([WARPS, 16, SUB], -INT4_HIGH_OFFSET, gl.float16, layout=v_operand)
        if CHANNEL:
            # Constant operands: dots with them sum the query's products over the dims (_channel_block_scores).
            key_ones = gl.full([WARPS, BLOCK_SIZE, HALF], 1.0, gl.float16, layout=k_operand)
            key_offsets = gl.full([WARPS, BLOCK_SIZE, HALF], -1024.0, gl.float16, layout=k_operand)
            block_zero = gl.zeros([WARPS, BLOCK_SIZE, HEADS], gl.float32, layout=mma)
        scale_blocks = _block_ids(table_row, positions + TILE, end, LOG2_BLOCK)
        num_tiles = (end - start + TILE - 1) // TILE
        for index in range(num_tiles):
            tile_start = start + index * TILE
            positions = _tile_positions(tile_start, WARPS, SUB, HEAD_WARPS, token_rows)
            # Loads for later tiles first: nothing below waits on them in this iteration.
            nks0, nks1, nks2, nks3, nvs0, nvs1, nvs2, nvs3 = _tile_scales(
                k_scales_ptr, v_scales_ptr, scale_blocks, positions + TILE, end, scale_stride_block,
                scale_stride_token, scale_head_offset, K_GROUPS, V_GROUPS, BLOCK_SIZE, WIDE, not CHANNEL)
            scale_blocks = _block_ids(table_row, positions + 2 * TILE, end, LOG2_BLOCK)
            # This tile's copies are done (this thread's), then every thread's are, and every thread has
            # finished reading the slot the next copies overwrite (the previous iteration's).
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            slot_ahead = (index + STAGES - 1) % STAGES
            ahead = _tile_positions(tile_start + (STAGES - 1) * TILE, WARPS, SUB, HEAD_WARPS, rows)
            _issue_tile(k_ptr, v_ptr, k_bufs.index(slot_ahead), v_bufs.index(slot_ahead), copy_blocks, ahead, end,
                        stride_block, stride_token, head_offset, ROW_BYTES, BLOCK_SIZE, WIDE, copy)
            if CHANNEL:
                _issue_pairs(k_scales_ptr, pair_bufs.index(slot_ahead), pair_blocks, pair_ahead, end,
                             pair_stride_block, pair_stride_head, head0, HEAD_DIM, WARPS, HEAD_WARPS, WIDE, pair_copy)
                pair_ahead = pair_ahead + TILE
                pair_blocks = _block_ids(table_row, pair_ahead, end, LOG2_BLOCK)
            async_copy.commit_group()
            copy_blocks = _block_ids(table_row, ahead + TILE, end, LOG2_BLOCK)

            slot = index % STAGES
            if CHANNEL:
                pairs = pair_bufs.index(slot)
                block0 = _channel_block_scores(k_bufs.index(slot), pairs, q0, q1, key_ones, key_offsets, block_zero, 0,
                                               HEAD_DIM, BLOCK_SIZE, WARPS, k_operand, q_operand)
                block1 = block0
                block2 = block0
                block3 = block0
                if BLOCKS > 1:
                    block1 = _channel_block_scores(k_bufs.index(slot), pairs, q0, q1, key_ones, key_offsets, block_zero,
                                                   1, HEAD_DIM, BLOCK_SIZE, WARPS, k_operand, q_operand)
                if BLOCKS > 2:
                    block2 = _channel_block_scores(k_bufs.index(slot), pairs, q0, q1, key_ones, key_offsets, block_zero,
                                                   2, HEAD_DIM, BLOCK_SIZE, WARPS, k_operand, q_operand)
                    block3 = _channel_block_scores(k_bufs.index(slot), pairs, q0, q1, key_ones, key_offsets, block_zero,
                                                   3, HEAD_DIM, BLOCK_SIZE, WARPS, k_operand, q_operand)
                scores = _join_blocks(block0, block1, block2, block3, BLOCKS, WARPS, SUB, mma)
            else:
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

            if INT4:
                probs16 = probs.to(gl.float16)
                weights0 = _value_weights(probs16, vs0, p_operand)
                weights1 = weights0
                weights2 = weights0
                weights3 = weights0
                if V_GROUPS > 1:
                    weights1 = _value_weights(probs16, vs1, p_operand)
                if V_GROUPS > 2:
                    weights2 = _value_weights(probs16, vs2, p_operand)
                    weights3 = _value_weights(probs16, vs3, p_operand)
                # Scale groups of slice s's low and high nibbles; a group's offset term is computed once.
                L0: gl.constexpr = 0
                H0: gl.constexpr = HALF // V_GROUP
                L1: gl.constexpr = 32 // V_GROUP
                H1: gl.constexpr = (HALF + 32) // V_GROUP
                low_weights0 = _pick(weights0, weights1, weights2, weights3, L0)
                high_weights0 = _pick(weights0, weights1, weights2, weights3, H0)
                low_offsets0 = _offset_terms(low_weights0, low_ones, acc_zero)
                high_offsets0 = _offset_terms(high_weights0, high_ones, acc_zero)
                v_pairs = v_bufs.index(slot)._reinterpret(gl.int16, [WARPS, SUB, ROW_BYTES // 2], pairs_smem)
                acc0, acc1, acc2, acc3 = _pair_slice_update(
                    v_pairs, acc0, acc1, acc2, acc3, rescale, low_weights0, low_offsets0, high_weights0,
                    high_offsets0, 0, v_operand)
                if SLICES > 1:
                    low_weights1 = _pick(weights0, weights1, weights2, weights3, L1)
                    high_weights1 = _pick(weights0, weights1, weights2, weights3, H1)
                    low_offsets1 = low_offsets0
                    high_offsets1 = high_offsets0
                    if L1 != L0:
                        low_offsets1 = _offset_terms(low_weights1, low_ones, acc_zero)
                    if H1 != H0:
                        high_offsets1 = _offset_terms(high_weights1, high_ones, acc_zero)
                    acc4, acc5, acc6, acc7 = _pair_slice_update(
                        v_pairs, acc4, acc5, acc6, acc7, rescale, low_weights1, low_offsets1, high_weights1,
                        high_offsets1, 1, v_operand)
            else:
                weights0, top0 = _scaled_weights(probs, vs0, p_operand)
                v_stage.store(_to_f16(v_bufs.index(slot).load(copy), V_FORMAT))
                gl.thread_barrier()
                acc0 = acc0 * rescale + _chunk_update(v_stage, weights0, top0, v_operand, acc_zero)
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

        if HEAD_WARPS:
            # Each warp's state is its own KV head's.
            total_max = running_max
            total_sum = running_sum
            factors = running_sum              # a placeholder: _store_chunk merges nothing with HEAD_WARPS
        else:
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
                # High-nibble accumulators (part % 4 >= 2) hold 16 x their values.
                _store_chunk(_pick(_pick(acc0, acc1, acc2, acc3, part % 4), _pick(acc4, acc5, acc6, acc7, part % 4),
                                   acc0, acc0, part // 4) * (0.0625 if (part // 2) % 2 else 1.0),
                             factors, safe_sum, out_ptr, partial_out_ptr, seq, head0, split, write_final,
                             out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head,
                             partial_stride_split, 32 * (part // 4) + (part % 2) + HALF * ((part // 2) % 2), 2, 16,
                             GROUP, HEADS, WARPS, HEAD_WARPS, mma)
        else:
            _store_chunk(acc0, factors, safe_sum, out_ptr, partial_out_ptr, seq, head0, split, write_final,
                         out_stride_seq, out_stride_head, partial_stride_seq, partial_stride_head, partial_stride_split,
                         0, 1, HEAD_DIM, GROUP, HEADS, WARPS, HEAD_WARPS, mma)
        if write_final == 0:
            if HEAD_WARPS:
                lse_groups = gl.arange(0, HEADS, layout=gl.SliceLayout(0, head_cols))
                lse_heads = _warp_heads(head0, WARPS, True, head_cols) * GROUP + lse_groups[None, :]
                lse_mask = (lse_groups < GROUP)[None, :]
            else:
                lse_groups = gl.arange(0, HEADS, layout=gl.SliceLayout(0, head_cols))
                lse_heads = head0 * GROUP + lse_groups
                lse_mask = lse_groups < GROUP
            gl.store(partial_lse_ptr + seq * lse_stride_seq + lse_heads * lse_stride_head + split,
                     total_max + gl.log2(safe_sum), mask=lse_mask)


def head_warps(num_kv_heads: int, int4: bool) -> bool:
    """Whether a program's 4 warps each run their own KV head (HEAD_WARPS): for int4 caches whose KV
    heads come in fours. A position's 4 heads' 64-byte int4 rows are adjacent in the cache; copied
    together they take a quarter of the cache lines per copy instruction, which made int4 faster on
    an H200; 8-bit rows (128 bytes) gained nothing (measured: docs/kv_quantization.md#measurements):
    they keep one KV head per program, its warps on quarters of each tile's positions."""
    return int4 and num_kv_heads % NUM_WARPS == 0


def pipelined_programs_per_sequence(num_kv_heads: int, int4: bool) -> int:
    """Programs per sequence and split (the grid's second axis)."""
    return num_kv_heads // NUM_WARPS if head_warps(num_kv_heads, int4) else num_kv_heads


def pipelined_config(num_kv_heads: int = 1, int4: bool = False) -> DecodeConfig:
    """Launch shape: 2 ring slots, so one tile is in flight while one is computed; tiles of 64
    positions with each warp on its own KV head, else of 128 (32 per warp). Measured on an H200 at
    32k context, batch 32, bf16 queries: 8-bit caches, 128 beats 64 with 2 or 3 slots; int4 with
    head warps, 64 beats 32 (figures: docs/kv_quantization.md#measurements)."""
    return DecodeConfig(tile=64 if head_warps(num_kv_heads, int4) else 128, num_warps=NUM_WARPS, num_stages=2,
                        min_split_tokens=128)


def _aligned(tensor: torch.Tensor) -> bool:
    """16-byte asynchronous copies: rows of codes start on 16-byte boundaries."""
    return (tensor.data_ptr() % 16 == 0 and tensor.stride(3) == 1
            and all(stride * tensor.element_size() % 16 == 0 for stride in tensor.stride()[:3]))


def _pairs_aligned(scales: torch.Tensor) -> bool:
    """Per-group scales come two (4 bytes) at a time: every position's row starts on 4 bytes."""
    return scales.data_ptr() % 4 == 0 and all(stride % 2 == 0 for stride in scales.stride()[:3])


def _needs_wide_offsets(k_cache, v_cache) -> bool:
    """64-bit element offsets, for a part whose codes or scales span 2^31 elements or more."""
    return any(max(part.payload.numel(), part.scales.numel()) >= 2 ** 31 for part in (k_cache, v_cache))


def _channel_pairs_supported(k_cache, head_dim: int, block_size: int) -> bool:
    """Per-channel int4 keys: each block of a warp's positions in a tile gets its own key dot (so blocks
    of 16 to a warp's whole share of a tile), and its (scale, zero) rows come by 16-byte copies."""
    sub = pipelined_config(k_cache.shape[2], True).tile
    if not head_warps(k_cache.shape[2], True):
        sub //= NUM_WARPS
    if block_size < 16 or sub % block_size or sub // block_size > 4:
        return False
    pairs = k_cache.scales
    return (pairs.stride(3) == 1 and pairs.stride(2) == head_dim and pairs.data_ptr() % 16 == 0
            and all(stride * pairs.element_size() % 16 == 0 for stride in pairs.stride()[:2]))


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
    if v_cache.fmt.per_channel:
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
    if any(part.scales is None for part in parts):
        return False
    if k_cache.payload.stride() != v_cache.payload.stride():
        return False                            # one row offset serves both parts
    if k_cache.fmt.per_channel:
        # A window would start the quantized positions past the sinks, inside a block: each key dot
        # covers one whole block.
        if any(part.window is not None for part in parts) or not _channel_pairs_supported(k_cache, head_dim,
                                                                                           block_size):
            return False
    elif k_cache.scales.stride() != v_cache.scales.stride():
        return False                            # one scale row offset serves both parts
    for part in parts:
        fmt = part.fmt
        if fmt.per_channel:
            if not _aligned(part.payload):
                return False
            continue
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
    # Per-channel key pairs [blocks, kv_heads, 2, head_dim]: their own (block, head) strides; the
    # per-token scale strides are then the values'.
    pair_strides = (k_cache.scales.stride(0), k_cache.scales.stride(1)) if k_cache.fmt.per_channel else (0, 0)
    return _decode_split_pipelined_kernel[grid](
        query, k_cache.payload, v_cache.payload, k_cache.scales, v_cache.scales, block_tables, context_lens,
        out, partial_out, partial_lse, scale_log2 / prescale, num_splits, write_final,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.payload.stride()[:3], *v_cache.scales.stride()[:3], *pair_strides, *partial_strides,
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, TILE=config.tile, STAGES=config.num_stages,
        MIN_SPLIT_TOKENS=config.min_split_tokens, K_FORMAT=format_code(k_cache.fmt),
        V_FORMAT=FORMAT_CODES[v_cache.fmt.name], K_GROUP=min(k_cache.fmt.group(head_dim), head_dim),
        V_GROUP=min(v_cache.fmt.group(head_dim), head_dim), BLOCK_SIZE=k_cache.shape[1], PRESCALE=prescale,
        SINKS=ring[0], WINDOW=ring[1], WIDE=_needs_wide_offsets(k_cache, v_cache),
        HEAD_WARPS=head_warps(k_cache.shape[2], k_cache.fmt.name == "int4"), PDL=pdl_enabled(query.device),
        num_warps=config.num_warps, **extra)

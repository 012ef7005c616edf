"""Pipelined fused-dequant paged decode attention for 8-bit KV caches (Gluon; NVIDIA sm_80+).

Reference: `kvserve.kernels.quant_reference.paged_decode_attention`; the same grid, split-KV scheme,
partial-output layout and combine kernel as decode_attention_quant.py, whose Triton kernel serves
every other case (int4, static scales, full-precision windows, fp32 queries, the interpreter).

Why a second kernel: the Triton one is latency-bound. Each loop iteration waits for its own K/V
bytes, then runs its dependent chain of dots and reductions, so a program never has a tile in
flight while it computes (Triton 3.6's pipeliner leaves the gathered block-table loads in the same
iteration: docs/kv_quantization.md). Here the loop is written out with explicit asynchronous copies
into a ring of STAGES shared-memory buffers: while tile i is computed, tiles i+1 .. i+STAGES-1 are
on their way. Block ids for the copies are loaded one iteration before the copies that use them,
and the 2-byte per-token scales (too small for an asynchronous copy) one tile ahead of their use,
from block ids loaded one iteration earlier still; so no load waits in the iteration that issues it.

What it covers (`pipelined_supported`): K and V each int8 or fp8-e4m3 with dynamic per-token
scales, no full-precision window, head_dim 64 or 128, a GQA group of at most 16, fp16/bf16 queries.
Codes become exact fp16 values by byte permutes under an fp16 exponent (int8) or the packed
e4m3x2 -> f16x2 conversion, as in decode_attention_quant.py; key scales multiply the [group, tile]
scores, value scales the probabilities (divided by the tile's largest scale, which multiplies the
update). Keys are read from shared memory straight into the dot's operand registers (4 consecutive
channels per 32-bit load); value codes are converted to fp16 and staged once more in shared memory,
because P @ V reduces over positions, which are not adjacent in a row of codes.
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
from kvserve.kernels.triton.code_conversion import E4M3_TO_F16_PTX, INT8_TO_F16_PTX, BF16_QUERY_PRESCALE
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
    def _token_scales(scales_ptr, blocks, positions, end, stride_block, stride_token, head_offset,
                      BLOCK_SIZE: gl.constexpr):
        """fp16 per-token scales of a tile's positions (0 past `end`)."""
        rows = blocks.to(gl.int64) * stride_block + ((positions & (BLOCK_SIZE - 1)) * stride_token + head_offset)
        return gl.load(scales_ptr + rows, mask=positions < end, other=0.0)

    @gluon.jit
    def _issue_tile(k_ptr, v_ptr, k_buf, v_buf, blocks, positions, end,
                    k_stride_block, k_stride_token, k_head_offset, v_stride_block, v_stride_token, v_head_offset,
                    HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, copy: gl.constexpr):
        """Asynchronous copies of a tile's K and V codes ([WARPS, SUB] positions) into one ring slot
        (zeros past `end`)."""
        valid = positions < end
        offsets = positions & (BLOCK_SIZE - 1)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, copy)))[None, None, :]
        base = blocks.to(gl.int64)
        k_rows = base * k_stride_block + (offsets * k_stride_token + k_head_offset)
        async_copy.async_copy_global_to_shared(k_buf, k_ptr + k_rows[:, :, None] + cols, mask=valid[:, :, None])
        v_rows = base * v_stride_block + (offsets * v_stride_token + v_head_offset)
        async_copy.async_copy_global_to_shared(v_buf, v_ptr + v_rows[:, :, None] + cols, mask=valid[:, :, None])

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
            BLOCK_SIZE: gl.constexpr, PRESCALE: gl.constexpr):
        WARPS: gl.constexpr = 4
        SUB: gl.constexpr = TILE // WARPS
        LOG2_BLOCK: gl.constexpr = BLOCK_SIZE.bit_length() - 1
        HEADS: gl.constexpr = 8
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
        copy: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32 * 16 // HEAD_DIM, HEAD_DIM // 16], [WARPS, 1, 1],
                                              [2, 1, 0])
        CHUNKS: gl.constexpr = HEAD_DIM // 16
        codes_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=8 // CHUNKS, max_phase=CHUNKS,
                                                            order=[2, 1, 0])
        values_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])
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

        # q^T [D, 8] of the group (heads past GROUP are 0), times PRESCALE (a power of 2) so that any
        # bf16 value fits fp16, the same for every warp.
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8, 1], [1, 4, 8], [WARPS, 1, 1], [1, 2, 0])
        q_dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(2, q_layout)))
        q_heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, gl.SliceLayout(1, q_layout)))
        q_warps = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, q_layout)))
        q_ptrs = (query_ptr + seq * query_stride_seq + q_warps[:, None, None] * 0
                  + (kv_head * GROUP + q_heads)[None, None, :] * query_stride_head + q_dims[None, :, None])
        q = gl.load(q_ptrs, mask=(q_heads < GROUP)[None, None, :], other=0.0)
        q = gl.convert_layout((q.to(gl.float32) * PRESCALE).to(gl.float16), q_operand)

        k_bufs = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [STAGES, WARPS, SUB, HEAD_DIM], codes_smem)
        v_bufs = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [STAGES, WARPS, SUB, HEAD_DIM], codes_smem)
        v_stage = gl.allocate_shared_memory(gl.float16, [WARPS, SUB, HEAD_DIM], values_smem)

        table_row = block_tables_ptr + seq * block_table_stride_seq
        k_head = kv_head * k_stride_head
        v_head = kv_head * v_stride_head
        ks_head = kv_head * ks_stride_head
        vs_head = kv_head * vs_stride_head

        # Prologue: tiles 0 .. STAGES-2 in flight, one commit group each.
        for s in gl.static_range(STAGES - 1):
            positions = _tile_positions(start + s * TILE, WARPS, SUB, rows)
            blocks = _block_ids(table_row, positions, end, LOG2_BLOCK)
            _issue_tile(k_ptr, v_ptr, k_bufs.index(s), v_bufs.index(s), blocks, positions, end,
                        k_stride_block, k_stride_token, k_head, v_stride_block, v_stride_token, v_head,
                        HEAD_DIM, BLOCK_SIZE, copy)
            async_copy.commit_group()
        copy_blocks = _block_ids(table_row, _tile_positions(start + (STAGES - 1) * TILE, WARPS, SUB, rows), end,
                                 LOG2_BLOCK)
        positions = _tile_positions(start, WARPS, SUB, token_rows)
        scale_blocks = _block_ids(table_row, positions, end, LOG2_BLOCK)
        ks = _token_scales(k_scales_ptr, scale_blocks, positions, end, ks_stride_block, ks_stride_token, ks_head,
                           BLOCK_SIZE)
        vs = _token_scales(v_scales_ptr, scale_blocks, positions, end, vs_stride_block, vs_stride_token, vs_head,
                           BLOCK_SIZE)
        scale_blocks = _block_ids(table_row, positions + TILE, end, LOG2_BLOCK)

        running_max = gl.full([WARPS, HEADS], float("-inf"), gl.float32, layout=head_cols)
        running_sum = gl.zeros([WARPS, HEADS], gl.float32, layout=head_cols)
        acc = gl.zeros([WARPS, HEAD_DIM, HEADS], gl.float32, layout=mma)
        num_tiles = (end - start + TILE - 1) // TILE
        for index in range(num_tiles):
            tile_start = start + index * TILE
            positions = _tile_positions(tile_start, WARPS, SUB, token_rows)
            # Loads for later tiles first: nothing below waits on them in this iteration.
            next_ks = _token_scales(k_scales_ptr, scale_blocks, positions + TILE, end, ks_stride_block,
                                    ks_stride_token, ks_head, BLOCK_SIZE)
            next_vs = _token_scales(v_scales_ptr, scale_blocks, positions + TILE, end, vs_stride_block,
                                    vs_stride_token, vs_head, BLOCK_SIZE)
            scale_blocks = _block_ids(table_row, positions + 2 * TILE, end, LOG2_BLOCK)
            # This tile's copies are done (this thread's), then every thread's are, and every thread has
            # finished reading the slot the next copies overwrite (the previous iteration's).
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            slot_ahead = (index + STAGES - 1) % STAGES
            ahead = _tile_positions(tile_start + (STAGES - 1) * TILE, WARPS, SUB, rows)
            _issue_tile(k_ptr, v_ptr, k_bufs.index(slot_ahead), v_bufs.index(slot_ahead), copy_blocks, ahead, end,
                        k_stride_block, k_stride_token, k_head, v_stride_block, v_stride_token, v_head,
                        HEAD_DIM, BLOCK_SIZE, copy)
            async_copy.commit_group()
            copy_blocks = _block_ids(table_row, ahead + TILE, end, LOG2_BLOCK)

            slot = index % STAGES
            keys = _to_f16(k_bufs.index(slot).load(k_operand), K_FORMAT)
            scores = mma_v2(keys, q, gl.zeros([WARPS, SUB, HEADS], gl.float32, layout=mma))
            scores = gl.where((positions < end)[:, :, None],
                              scores * (ks.to(gl.float32) * key_scale_log2)[:, :, None], float("-inf"))
            new_max = gl.maximum(running_max, gl.max(scores, axis=1))
            # A warp with no position yet (all of its positions past `end`) keeps max -inf; exp2(-inf - -inf)
            # would be NaN, so it subtracts 0 instead (its probabilities are exp2(-inf) = 0).
            safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = gl.exp2(running_max - safe_max)
            probs = gl.exp2(scores - safe_max[:, None, :])
            running_sum = running_sum * rescale + gl.sum(probs, axis=1)
            running_max = new_max

            values = _to_f16(v_bufs.index(slot).load(copy), V_FORMAT)
            v_stage.store(values)
            gl.thread_barrier()
            value_scales = vs.to(gl.float32)
            top = gl.maximum(gl.max(value_scales, axis=1), 1e-30)
            weights = gl.convert_layout((probs * (value_scales / top[:, None])[:, :, None]).to(gl.float16),
                                        p_operand)
            update = mma_v2(v_stage.permute([0, 2, 1]).load(v_operand), weights,
                            gl.zeros([WARPS, HEAD_DIM, HEADS], gl.float32, layout=mma))
            acc = acc * rescale[:, None, :] + update * top[:, None, None]
            ks = next_ks
            vs = next_vs
        async_copy.wait_group(0)

        # Merge the warps' states: each warp's sum and accumulator rescaled to the common maximum.
        total_max = gl.max(running_max, axis=0)
        safe_max = gl.where(total_max == float("-inf"), 0.0, total_max)
        factors = gl.exp2(running_max - safe_max[None, :])
        total_sum = gl.sum(running_sum * factors, axis=0)
        merged = gl.sum(acc * gl.convert_layout(factors, head_cols)[:, None, :], axis=0)
        # A row that saw no position (only for context_len == 0) has sum 0 and acc 0 -> 0.
        safe_sum = gl.where(total_sum > 0, total_sum, 1.0)
        out_layout: gl.constexpr = gl.SliceLayout(0, mma)
        result = merged / gl.convert_layout(safe_sum, gl.SliceLayout(0, out_layout))[None, :]
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, out_layout))
        groups = gl.arange(0, HEADS, layout=gl.SliceLayout(0, out_layout))
        heads = kv_head * GROUP + groups
        group_mask = groups < GROUP
        if write_final != 0:
            gl.store(out_ptr + seq * out_stride_seq + heads[None, :] * out_stride_head + dims[:, None],
                     result.to(out_ptr.dtype.element_ty), mask=group_mask[None, :])
        else:
            gl.store(partial_out_ptr + seq * partial_stride_seq + heads[None, :] * partial_stride_head
                     + split * partial_stride_split + dims[:, None], result, mask=group_mask[None, :])
            lse_groups = gl.arange(0, HEADS, layout=gl.SliceLayout(0, head_cols))
            gl.store(partial_lse_ptr + seq * lse_stride_seq + (kv_head * GROUP + lse_groups) * lse_stride_head
                     + split, total_max + gl.log2(safe_sum), mask=lse_groups < GROUP)


def pipelined_config() -> DecodeConfig:
    """Launch shape: tiles of 128 positions (32 per warp) and 2 ring slots, so one tile is in flight
    while one is computed. Measured on an H200 at 32k context, batch 32, bf16 queries
    (benchmarks/results/kv_quant_pipelined_h200.json): faster than tiles of 64 with 2 or 3 slots (4 or
    3 programs per SM), and than 3 slots under a 128-register cap (spills)."""
    return DecodeConfig(tile=128, num_warps=NUM_WARPS, num_stages=2, min_split_tokens=128)


def _aligned(tensor: torch.Tensor) -> bool:
    """16-byte asynchronous copies: rows of codes start on 16-byte boundaries."""
    return (tensor.data_ptr() % 16 == 0 and tensor.stride(3) == 1
            and all(stride * tensor.element_size() % 16 == 0 for stride in tensor.stride()[:3]))


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
    for part in parts:
        fmt = part.fmt
        if fmt.name not in ("int8", "fp8_e4m3") or fmt.static_scales or part.window is not None:
            return False
        if fmt.group(head_dim) != head_dim or part.scales is None or not _aligned(part.payload):
            return False
        if fmt.name == "fp8_e4m3" and capability < (8, 9):
            return False
    return capability >= (8, 0)


def launch_pipelined(grid: tuple[int, int, int], query: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale_log2: float, out: torch.Tensor, partial_out: torch.Tensor,
                     partial_lse: torch.Tensor, num_splits: int, write_final: int, config: DecodeConfig,
                     partial_strides: tuple[int, ...]):
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
        V_FORMAT=FORMAT_CODES[v_cache.fmt.name], BLOCK_SIZE=k_cache.shape[1], PRESCALE=prescale,
        num_warps=config.num_warps, **extra)

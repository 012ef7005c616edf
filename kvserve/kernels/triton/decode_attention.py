"""Paged decode attention: one query token per sequence over its context in the paged KV cache.

Reference: `kvserve.kernels.reference.paged_decode_attention` (which takes a context mask; this
kernel takes the context lengths the mask is built from).

Design (flash-decoding, GQA-aware):
- Grid (batch, kv_heads, num_splits). A program owns one KV head of one sequence and one slice of
  its context. It loads each K/V tile once and serves every query head of the GQA group with it:
  the group's queries are a [GROUP_PAD, head_dim] matrix (padded to 16 rows for `tl.dot`), so the
  scores and P@V are tensor-core dots and K/V bytes are read once per KV head, never per query head.
- A tile is TILE consecutive context positions. Positions map to cache rows through the block
  table (`block = table[pos // block_size]`), so the tile size is independent of the cache's block
  size: any block size works (a runtime argument), and a tile may span several blocks or part of one.
- Online softmax in fp32 (exp2 with the scale folded into log2 units).
- Split-KV: the context of every sequence is cut into `num_splits` slices computed on the device
  from its own length (slices of at least `min_split_tokens`, rounded to whole tiles), so a short
  sequence uses few programs and a long one uses all of them. Each split writes a normalised
  partial output and its log-sum-exp; a second kernel combines the active splits. With one split
  the first kernel writes the output directly and the second is not launched (a runtime flag, so
  the same compiled kernel serves both).
- The split count (see choose_num_splits) is 1 once the unsplit programs fill 3/4 of the GPU's
  resident slots, and below that fills the GPU in whole waves, using the occupancy of the compiled
  kernel once it has run.
- CUDA-graph safe: the grid is (batch, kv_heads, num_splits), where num_splits comes from host
  values fixed for a captured graph (batch, kv heads, an upper bound of the context length: by
  default the block table's width). Context lengths and block tables are read on the device only;
  programs past a sequence's context return at once. A context length of 0 (a padding row of a
  graph batch) yields zeros.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.triton._common import (SPLIT_COMBINE_DYNAMIC_ARGS, SPLIT_DECODE_DYNAMIC_ARGS, cdiv, interpreting,
                                            next_power_of_2, num_sms, pdl_enabled)

LOG2_E = 1.4426950408889634
MAX_SPLITS = 256
# Splits the combine kernel reduces per iteration. Small on purpose: a launch rarely has more than
# a few splits, and every masked-out row of the [chunk, head_dim] tile still costs its arithmetic.
# At 64 the combine was a tenth of a batch-128 decode step on an H200 (measured:
# docs/gpu_performance.md#decode-throughput-by-batch-size). A constant, not the next power of two
# of num_splits, so a new split count never compiles a variant.
COMBINE_SPLIT_CHUNK = 8
# Programs of the split kernel resident per SM before the first launch has told us (then the
# compiled kernel's registers and shared memory give the real figure): ~5 on an H100/H200 for the
# bf16 head_dim-128 default (96 registers x 128 threads, 39 KB of shared memory).
DEFAULT_RESIDENT_PER_SM = 4
# A split count is good enough when its wave efficiency is within this factor of the best one; the
# smallest such count wins (fewer partial results to write and combine).
WAVE_EFFICIENCY_SLACK = 0.9
# From this share of the resident slots on, one split per (sequence, KV head): that many programs
# already stream at the copy bandwidth, and splitting only adds partials, a combine and a second
# wave. Measured on an H200 (benchmarks/results/kernels/h200_attention_split_sweep.json, 660 slots):
# at 512 programs (0.78) one split beat the wave-filling choice at contexts 1k-8k; at 384 programs
# (0.58) the wave-filling 5 splits won from 4k on, one split below (figures:
# docs/gpu_performance.md#decode-throughput-by-batch-size).
SINGLE_SPLIT_FILL = 0.75


@dataclass(frozen=True)
class DecodeConfig:
    tile: int = 64                # context positions per loop iteration
    num_warps: int = 4
    num_stages: int = 2
    use_dot: bool = True          # False: broadcast-multiply-sum (for tiny groups and tiles)
    min_split_tokens: int = 128   # a split never covers fewer positions (unless the context is shorter)
    # Quantized-cache kernel only (decode_attention_quant): a tile's block ids loaded one iteration
    # ahead (with its scales'), and a cap on registers per thread (more programs per SM).
    ids_ahead: bool = False
    max_registers: int | None = None


def default_decode_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    if interpreting():
        # Small tiles so that the interpreter's tests cross many tile and block boundaries.
        return DecodeConfig(tile=16, num_warps=1, num_stages=1, min_split_tokens=32)
    if dtype == torch.float32:
        # fp32 dots run on FMA units ("ieee"): small tiles keep them out of register spills.
        return DecodeConfig(tile=16, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return DecodeConfig(tile=128, num_warps=4, num_stages=2)
    return DecodeConfig(tile=64, num_warps=4, num_stages=2)


def active_splits(context_len: int, num_splits: int, config: DecodeConfig) -> int:
    """Splits that hold positions for a context of `context_len` (host twin of _split_length)."""
    if context_len <= 0:
        return 0
    split_len = cdiv(max(cdiv(context_len, num_splits), config.min_split_tokens), config.tile) * config.tile
    return cdiv(context_len, split_len)


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      config: DecodeConfig | None = None, resident_per_sm: int | None = None) -> int:
    """Splits per (sequence, KV head), from host values that a CUDA graph fixes at capture.

    With SINGLE_SPLIT_FILL of the slots or more programs unsplit, one split. Below that, the split
    kernel's programs all do about the same work, so time goes in waves of `resident_per_sm * SMs`
    programs: a last wave that is mostly empty wastes bandwidth (64 sequences x 4 KV heads x 3
    splits = 768 programs on 660 slots against 32 x 4 x 5 = 640; measured:
    docs/gpu_performance.md#decode-attention-kernel). Among split counts whose splits are at least
    min_split_tokens long at `max_context_len`, take the smallest whose wave efficiency (waves /
    ceil(waves)) is within WAVE_EFFICIENCY_SLACK of the best; below one wave, efficiency grows with
    the split count, so an underfilled GPU gets as many splits as the context allows.
    """
    config = config or DecodeConfig()
    slots = (resident_per_sm or DEFAULT_RESIDENT_PER_SM) * num_sms(device)
    return _choose_num_splits(max(1, batch * num_kv_heads), max(1, max_context_len), slots, config)


@functools.lru_cache(maxsize=4096)         # called per layer and step with the same arguments
def _choose_num_splits(programs: int, max_context_len: int, slots: int, config: DecodeConfig) -> int:
    if programs >= SINGLE_SPLIT_FILL * slots:
        return 1
    candidates = []                        # (num_splits, wave efficiency)
    previous_active = 0
    for num_splits in range(1, MAX_SPLITS + 1):
        active = active_splits(max_context_len, num_splits, config)
        if active == previous_active:
            continue                       # same launch shape as a smaller count
        previous_active = active
        waves = programs * active / slots
        candidates.append((num_splits, waves / math.ceil(waves)))
        if active < num_splits:            # the context cannot be cut finer
            break
    best = max(efficiency for _, efficiency in candidates)
    return next(num_splits for num_splits, efficiency in candidates if efficiency >= WAVE_EFFICIENCY_SLACK * best)


_resident_per_sm: dict[tuple, int] = {}


def _resident_programs(compiled, device: torch.device) -> int | None:
    """Programs of a compiled kernel one SM holds at once (registers, shared memory, threads)."""
    try:
        num_regs, shared, warps = compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps
        props = torch.cuda.get_device_properties(device)
    except Exception:                      # interpreter, or a Triton without these fields
        return None
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    shared_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    regs_per_warp = cdiv(max(1, num_regs) * 32, 256) * 256          # allocated per warp in units of 256
    by_regs = regs_per_sm // (regs_per_warp * warps)
    by_shared = shared_per_sm // (shared + 1024) if shared else 32   # 1 KB reserved per block
    by_threads = threads_per_sm // (32 * warps)
    return max(1, min(by_regs, by_shared, by_threads, 32))


def decode_workspace(batch: int, num_heads: int, head_dim: int, num_splits: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs [batch, heads, splits, head_dim] fp32, log2-sum-exp [batch, heads, splits]
    fp32) for a split launch; preallocate them once to keep a captured graph's memory fixed."""
    return (torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device))


def unused_partials(out: torch.Tensor) -> torch.Tensor:
    """What a one-split launch passes for the partial buffers it never touches (write_final): an
    fp32 view of `out`, so the pointer dtypes match a split launch's and both share one compiled
    kernel (a one-split batch size reached mid-serving would otherwise compile a second variant)."""
    return out.view(torch.float32)


@triton.jit
def _split_length(context_len, num_splits, TILE: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr):
    """Positions per split for one sequence; both kernels must agree on it."""
    per_split = tl.maximum(tl.cdiv(context_len, num_splits), MIN_SPLIT_TOKENS)
    return tl.cdiv(per_split, TILE) * TILE


# Values that change from step to step in eager mode (split count, block table width, whether this
# launch writes the output directly) are runtime arguments that Triton must not specialise on (it
# would compile variants for 1 and for multiples of 16, stalling a step mid-serving). The cache
# block size is one too: one compiled kernel serves every block size.
@triton.jit(do_not_specialize=SPLIT_DECODE_DYNAMIC_ARGS)
def _decode_split_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, partial_out_ptr, partial_lse_ptr,
        scale_log2, num_splits, block_size, write_final,
        query_stride_seq, query_stride_head,
        out_stride_seq, out_stride_head,
        block_table_stride_seq,
        cache_stride_block, cache_stride_token, cache_stride_head,
        partial_stride_seq, partial_stride_head, partial_stride_split,
        lse_stride_seq, lse_stride_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        TILE: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:     # see _common.pdl_enabled
        gdc_wait()
        gdc_launch_dependents()
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
    # Probabilities enter P@V in the query dtype (the reference casts the cache to it, then the
    # probabilities to the values' dtype).
    value_dtype: tl.constexpr = query_ptr.dtype.element_ty
    table_row = block_tables_ptr + seq * block_table_stride_seq
    head_offset = kv_head * cache_stride_head
    for tile_start in range(start, end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < end
        blocks = tl.load(table_row + positions // block_size, mask=valid, other=0).to(tl.int64)
        rows = blocks * cache_stride_block + (positions % block_size) * cache_stride_token + head_offset
        kv_mask = valid[:, None] & dim_mask[None, :]
        keys = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        values = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        keys = keys.to(query.dtype)
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
                update = tl.dot(probs, values.to(value_dtype), input_precision=DOT_PRECISION)
        else:
            update = tl.sum(probs.to(tl.float32)[:, :, None] * values.to(tl.float32)[None, :, :], axis=1)
        acc = acc * rescale[:, None] + update
        running_max = new_max

    # A row that saw no position (only possible for context_len == 0) has sum 0 and acc 0 -> 0.
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


@triton.jit
def _merge_partials(lse_row, out_row, splits, split_mask, dims, dim_mask, partial_stride_split,
                    running_max, running_weight, acc):
    """Folds the partial outputs of `splits` into the running log-sum-exp merge. A partial over no
    position has lse -inf; while every one so far has, the merge subtracts 0 (not -inf - -inf)."""
    lse = tl.load(lse_row + splits, mask=split_mask, other=float("-inf"))
    new_max = tl.maximum(running_max, tl.max(lse, axis=0))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(running_max - safe_max)
    weights = tl.exp2(lse - safe_max)
    partials = tl.load(out_row + splits[:, None] * partial_stride_split + dims[None, :],
                       mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    acc = acc * rescale + tl.sum(weights[:, None] * partials, axis=0)
    running_weight = running_weight * rescale + tl.sum(weights, axis=0)
    return new_max, running_weight, acc


@triton.jit(do_not_specialize=SPLIT_COMBINE_DYNAMIC_ARGS)
def _decode_combine_kernel(
        partial_out_ptr, partial_lse_ptr, context_lens_ptr, out_ptr, num_splits,
        partial_stride_seq, partial_stride_head, partial_stride_split,
        lse_stride_seq, lse_stride_head,
        out_stride_seq, out_stride_head,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TILE: tl.constexpr,
        MIN_SPLIT_TOKENS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, PDL: tl.constexpr = False,
        EXTRA_SPLIT: tl.constexpr = False):
    # EXTRA_SPLIT: slot `num_splits` holds one more partial, over positions the splits left out
    # (a quantized cache's full-precision window), written for every non-empty context.
    if PDL:     # see _common.pdl_enabled
        gdc_wait()
        gdc_launch_dependents()
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    split_len = _split_length(context_len, num_splits, TILE, MIN_SPLIT_TOKENS)
    # Only splits that started inside the context wrote anything.
    active_splits = tl.cdiv(context_len, split_len)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    lse_row = partial_lse_ptr + seq * lse_stride_seq + head * lse_stride_head
    out_row = partial_out_ptr + seq * partial_stride_seq + head * partial_stride_head

    running_max = tl.full([1], float("-inf"), tl.float32)
    running_weight = tl.zeros([1], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    for chunk_start in range(0, active_splits, SPLIT_CHUNK):
        splits = chunk_start + tl.arange(0, SPLIT_CHUNK)
        running_max, running_weight, acc = _merge_partials(
            lse_row, out_row, splits, splits < active_splits, dims, dim_mask, partial_stride_split,
            running_max, running_weight, acc)
    if EXTRA_SPLIT:
        extra = num_splits + tl.arange(0, 1)
        running_max, running_weight, acc = _merge_partials(
            lse_row, out_row, extra, extra < num_splits + (context_len > 0), dims, dim_mask, partial_stride_split,
            running_max, running_weight, acc)
    safe_weight = tl.where(running_weight > 0, running_weight, 1.0)
    result = acc / safe_weight
    tl.store(out_ptr + seq * out_stride_seq + head * out_stride_head + dims, result.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                           out: torch.Tensor | None = None, max_context_len: int | None = None,
                           num_splits: int | None = None,
                           workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                           config: DecodeConfig | None = None) -> torch.Tensor:
    """query [B, heads, D]; caches [num_blocks, block_size, kv_heads, D]; block_tables [B, max_blocks]
    (int32/int64; entries past a sequence's blocks are never read); context_lens [B] (int32/int64,
    0 = padding row -> zeros). Returns `out` (or a new tensor) [B, heads, D] in the query dtype.

    `max_context_len` bounds every context length; it only sizes the split count (default:
    block_tables.shape[1] * block_size). No host synchronisation: capturable in a CUDA graph.
    """
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"query head_dim {head_dim} vs caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share one layout with unit head_dim stride")
    if block_tables.shape[0] < batch or context_lens.shape[0] < batch:
        raise ValueError("block_tables/context_lens have fewer rows than the batch")
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if out.stride(2) != 1:
        raise ValueError("out needs a unit head_dim stride")
    config = config or default_decode_config(head_dim, query.dtype)
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    if config.use_dot:
        group_pad = max(16, group_pad)      # tl.dot needs M >= 16
        if config.tile < 16:
            raise ValueError("tl.dot needs a tile of at least 16 positions")
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    occupancy_key = _occupancy_key(query, k_cache, block_tables, config)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, query.device, config,
                                       _resident_per_sm.get(occupancy_key))
    interpret = interpreting()
    pdl = pdl_enabled(query.device)
    dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"
    meta = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=max(16, next_power_of_2(head_dim)),
                TILE=config.tile, MIN_SPLIT_TOKENS=config.min_split_tokens)
    scale_log2 = float(scale) * LOG2_E
    if num_splits == 1:
        compiled = _decode_split_kernel[(batch, num_kv_heads, 1)](
            query, k_cache, v_cache, block_tables, context_lens, out, unused_partials(out), unused_partials(out),
            scale_log2, 1, block_size, 1,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            0, 0, 0, 0, 0,
            USE_DOT=config.use_dot, DOT_UPCAST=interpret, DOT_PRECISION=dot_precision, PDL=pdl,
            num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl, **meta)
        _note_occupancy(occupancy_key, compiled, query.device)
        return out
    if workspace is None:
        workspace = decode_workspace(batch, num_heads, head_dim, num_splits, query.device)
    partial_out, partial_lse = workspace
    if (partial_out.shape[0] < batch or partial_out.shape[1] != num_heads or partial_out.shape[2] < num_splits
            or partial_out.shape[3] != head_dim or partial_out.stride(3) != 1
            or partial_out.dtype != torch.float32 or partial_lse.dtype != torch.float32
            or tuple(partial_lse.shape[:2]) != tuple(partial_out.shape[:2]) or partial_lse.shape[2] < num_splits):
        raise ValueError("workspace does not fit this launch (see decode_workspace)")
    compiled = _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens, out, partial_out, partial_lse,
        scale_log2, num_splits, block_size, 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        USE_DOT=config.use_dot, DOT_UPCAST=interpret, DOT_PRECISION=dot_precision, PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl, **meta)
    _note_occupancy(occupancy_key, compiled, query.device)
    _decode_combine_kernel[(batch, num_heads)](
        partial_out, partial_lse, context_lens, out, num_splits,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=meta["DIM_PAD"], TILE=config.tile,
        MIN_SPLIT_TOKENS=config.min_split_tokens, SPLIT_CHUNK=COMBINE_SPLIT_CHUNK, PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return out


def decode_num_splits(query: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                      max_context_len: int | None = None, config: DecodeConfig | None = None) -> int:
    """The split count paged_decode_attention picks for these arguments (to size a workspace ahead
    of a CUDA-graph capture, say). Uses the kernel's measured occupancy once it has run."""
    config = config or default_decode_config(query.shape[2], query.dtype)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * k_cache.shape[1]
    return choose_num_splits(query.shape[0], k_cache.shape[2], max_context_len, query.device, config,
                             _resident_per_sm.get(_occupancy_key(query, k_cache, block_tables, config)))


def measured_occupancy() -> dict[str, int]:
    """Programs per SM of each split-kernel variant launched so far (for benchmark reports)."""
    return {f"{dtype}/{cache_dtype}/group{group}/d{head_dim}/{config}": resident
            for (_, dtype, cache_dtype, _, group, head_dim, config), resident in _resident_per_sm.items()}


def _occupancy_key(query: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                   config: DecodeConfig) -> tuple:
    num_heads, head_dim = query.shape[1:]
    return (query.device, query.dtype, k_cache.dtype, block_tables.dtype, num_heads // k_cache.shape[2],
            head_dim, config)


def _note_occupancy(key: tuple, compiled, device: torch.device) -> None:
    if key not in _resident_per_sm:
        resident = _resident_programs(compiled, device)
        if resident is not None:
            _resident_per_sm[key] = resident

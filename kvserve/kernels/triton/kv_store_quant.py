"""Quantize-on-write store of one part (K or V) of a quantized paged cache.

Reference: `QuantizedKVCache.store` in kvserve.kvstore (payload + fp16 scales; the window
ring copy is a plain index_copy_ the backend does in torch). One program per token quantizes all
of its KV heads: dynamic scales are absmax / qmax per group of GROUP head_dim elements, rounded to
fp16 before use so the reader multiplies by exactly the stored scale. int4 packs element i (low
nibble) with element i + head_dim/2 (high nibble): the kernel works on the two halves of the head
separately, so a group must lie inside one half (GROUP divides head_dim/2) or be the whole head.
A slot of -1 (CUDA-graph padding) writes nothing.

Per-channel int4 keys (`_store_channel_kernel`, formats.py): one program per token and KV head;
the program of the first token of each run of tokens in one block (the previous token is in
another block) does the run's write, the others only copy their token into the window ring if the
part keeps one. It widens the block's (scale, zero) pair per channel to take the run's tokens
(from scratch when the run starts the block), re-encodes the block's earlier codes of the channels
whose pair changed, and encodes the run. Same arithmetic as `QuantizedKVCache._store_channel`, so
bytes and scales match it exactly. Any head_dim (even) and block size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton._common import next_power_of_2

# Format codes shared with decode_attention_quant (format_code: 4 for int4 per channel and block).
FORMAT_CODES = {"int8": 1, "fp8_e4m3": 2, "int4": 3}
CHANNEL_FORMAT = 4


def format_code(fmt) -> int:
    """A quantized format's code in the kernels: FORMAT_CODES, or CHANNEL_FORMAT for per-channel int4."""
    return CHANNEL_FORMAT if fmt.per_channel else FORMAT_CODES[fmt.name]

# A jitted kernel may read a module global only when it is a constexpr (Triton raises otherwise on CUDA;
# the interpreter does not check).
MIN_SCALE = tl.constexpr(2.0 ** -14)


@triton.jit
def _div(x, y):
    """x / y rounded as IEEE division (as torch divides). Triton lowers an fp32 `/` on NVIDIA GPUs
    to `div.full.f32`, an approximation within 2 ulp: a quotient next to a rounding boundary (a
    code's .5, or an fp16 scale's half ulp) then lands on the other side of it and the stored byte
    or scale differs from the reference's. (The interpreter divides exactly, so it never showed.)"""
    return tl.math.div_rn(x, y)


@triton.jit
def _round_half_even(x):
    """torch.round (half to even) for |x| < 2^22: adding and removing 1.5 * 2^23 leaves no
    fraction bits, and fp32 addition rounds to nearest even. (Inputs are clamped first.)"""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _encode(scaled, FORMAT: tl.constexpr):
    if FORMAT == 1:
        rounded = _round_half_even(tl.minimum(tl.maximum(scaled, -200.0), 200.0))
        return tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)
    elif FORMAT == 2:
        clamped = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
        return clamped.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        rounded = _round_half_even(tl.minimum(tl.maximum(scaled, -16.0), 16.0))
        return (tl.minimum(tl.maximum(rounded, -7.0), 7.0) + 8.0).to(tl.uint8)


@triton.jit
def _group_scales(x, QMAX: tl.constexpr, HEADS_PAD: tl.constexpr, NUM_GROUPS: tl.constexpr,
                  GROUP: tl.constexpr):
    """x [HEADS_PAD, NUM_GROUPS * GROUP] fp32 -> per-element fp32 scales (fp16-rounded) and the
    [HEADS_PAD, NUM_GROUPS] fp16 scales to store."""
    grouped = tl.reshape(tl.abs(x), (HEADS_PAD, NUM_GROUPS, GROUP))
    scales = tl.maximum(_div(tl.max(grouped, axis=2), QMAX), MIN_SCALE).to(tl.float16)
    per_element = tl.reshape(tl.broadcast_to(scales.to(tl.float32)[:, :, None], (HEADS_PAD, NUM_GROUPS, GROUP)),
                             (HEADS_PAD, NUM_GROUPS * GROUP))
    return per_element, scales


@triton.jit
def _store_quant_kernel(x_ptr, payload_ptr, scales_ptr, static_ptr, slot_ptr, ring_ptr, ring_slots_ptr,
                        x_stride_token, x_stride_head,
                        payload_stride_slot, payload_stride_head, scales_stride_slot, scales_stride_head,
                        ring_stride_slot, ring_stride_head, ring_slots_stride_token,
                        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                        FORMAT: tl.constexpr, QMAX: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr,
                        RING_COLUMNS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    head_mask = heads < NUM_KV_HEADS
    x_row = x_ptr + token * x_stride_token + heads * x_stride_head
    if RING_COLUMNS > 0:
        # The full-precision ring (window, sinks) in the same launch: every token, as the reference's
        # index_copy_ does (slots outside the ring, and graph padding, point at its trash row).
        ring_dims = tl.arange(0, HEAD_DIM)[None, :]
        exact = tl.load(x_row + ring_dims, mask=head_mask, other=0.0).to(ring_ptr.dtype.element_ty)
        for column in tl.static_range(RING_COLUMNS):
            ring_slot = tl.load(ring_slots_ptr + token * ring_slots_stride_token + column).to(tl.int64)
            tl.store(ring_ptr + ring_slot * ring_stride_slot + heads * ring_stride_head + ring_dims, exact,
                     mask=head_mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    if FORMAT == 3:
        HALF: tl.constexpr = HEAD_DIM // 2
        dims = tl.arange(0, HALF)[None, :]
        low = tl.load(x_row + dims, mask=head_mask, other=0.0).to(tl.float32)
        high = tl.load(x_row + HALF + dims, mask=head_mask, other=0.0).to(tl.float32)
        if STATIC:
            low_scale = tl.load(static_ptr + heads * HEAD_DIM + dims, mask=head_mask, other=1.0)
            high_scale = tl.load(static_ptr + heads * HEAD_DIM + HALF + dims, mask=head_mask, other=1.0)
        elif GROUP == HEAD_DIM:
            amax = tl.maximum(tl.max(tl.abs(low), axis=1), tl.max(tl.abs(high), axis=1))
            scale = tl.maximum(_div(amax, QMAX), MIN_SCALE).to(tl.float16)
            tl.store(scales_ptr + slot * scales_stride_slot + tl.arange(0, HEADS_PAD) * scales_stride_head,
                     scale, mask=tl.arange(0, HEADS_PAD) < NUM_KV_HEADS)
            low_scale = scale.to(tl.float32)[:, None]
            high_scale = low_scale
        else:
            HALF_GROUPS: tl.constexpr = HALF // GROUP
            low_scale, low_stored = _group_scales(low, QMAX, HEADS_PAD, HALF_GROUPS, GROUP)
            high_scale, high_stored = _group_scales(high, QMAX, HEADS_PAD, HALF_GROUPS, GROUP)
            groups = tl.arange(0, HALF_GROUPS)[None, :]
            scale_row = scales_ptr + slot * scales_stride_slot + heads * scales_stride_head
            tl.store(scale_row + groups, low_stored, mask=head_mask)
            tl.store(scale_row + HALF_GROUPS + groups, high_stored, mask=head_mask)
        low_codes = _encode(_div(low, low_scale), 3)
        high_codes = _encode(_div(high, high_scale), 3)
        packed = low_codes | (high_codes << 4)
        tl.store(payload_ptr + slot * payload_stride_slot + heads * payload_stride_head + dims, packed,
                 mask=head_mask)
    else:
        dims = tl.arange(0, HEAD_DIM)[None, :]
        x = tl.load(x_row + dims, mask=head_mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr + heads * HEAD_DIM + dims, mask=head_mask, other=1.0)
        else:
            NUM_GROUPS: tl.constexpr = HEAD_DIM // GROUP
            scale, stored = _group_scales(x, QMAX, HEADS_PAD, NUM_GROUPS, GROUP)
            groups = tl.arange(0, NUM_GROUPS)[None, :]
            tl.store(scales_ptr + slot * scales_stride_slot + heads * scales_stride_head + groups, stored,
                     mask=head_mask)
        codes = _encode(_div(x, scale), FORMAT)
        tl.store(payload_ptr + slot * payload_stride_slot + heads * payload_stride_head + dims, codes,
                 mask=head_mask)


@triton.jit
def _encode_channel(x, zero, scale):
    """Codes in [0, 15] (fp32) of fp32 values with a channel's fp32 (zero, scale), as encode_channel."""
    scaled = _div(x - zero, scale)
    rounded = _round_half_even(tl.minimum(tl.maximum(scaled, -16.0), 32.0))
    return tl.minimum(tl.maximum(rounded, 0.0), 15.0)


@triton.jit
def _channel_half(x, old_bytes, in_run, written, grows, old_scale16, old_zero16, SHIFT: tl.constexpr):
    """One half of the head (the low or the high nibbles): the new fp16 (scale, zero) [HALF_PAD] of
    the run's tokens x [BS_PAD, HALF_PAD], the codes of the run, and the re-encoded codes of the
    block's earlier rows (old_bytes [BS_PAD, HALF_PAD], rows `written`)."""
    low = tl.min(tl.where(in_run[:, None], x, float("inf")), axis=0)
    high = tl.max(tl.where(in_run[:, None], x, float("-inf")), axis=0)
    old_scale = old_scale16.to(tl.float32)
    old_low = old_zero16.to(tl.float32)
    old_high = old_low + 15.0 * old_scale
    new_low = tl.where(grows, tl.minimum(low, old_low), low)
    new_high = tl.where(grows, tl.maximum(high, old_high), high)
    zero16 = new_low.to(tl.float16)
    scale16 = tl.maximum(_div(new_high - zero16.to(tl.float32), 15.0), MIN_SCALE).to(tl.float16)
    widened = (low < old_low) | (high > old_high)
    keep = grows & (widened == 0)
    zero16 = tl.where(keep, old_zero16, zero16)
    scale16 = tl.where(keep, old_scale16, scale16)
    zero = zero16.to(tl.float32)
    scale = scale16.to(tl.float32)
    old_codes = ((old_bytes >> SHIFT) & 0xF).to(tl.float32)
    recoded = _encode_channel(old_codes * old_scale[None, :] + old_low[None, :], zero[None, :], scale[None, :])
    recoded = tl.where((grows & widened)[None, :] & written[:, None], recoded, old_codes)
    codes = _encode_channel(x, zero[None, :], scale[None, :])
    return scale16, zero16, codes, recoded


@triton.jit
def _store_channel_kernel(x_ptr, payload_ptr, scales_ptr, slot_ptr, ring_ptr, ring_slots_ptr, num_tokens,
                          x_stride_token, x_stride_head,
                          payload_stride_block, payload_stride_token, payload_stride_head,
                          scales_stride_block, scales_stride_head, scales_stride_pair,
                          ring_stride_slot, ring_stride_head, ring_slots_stride_token,
                          HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BS_PAD: tl.constexpr, RING_COLUMNS: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    if RING_COLUMNS > 0:
        # The full-precision ring (window, sinks) of every token, as in _store_quant_kernel.
        x_row = x_ptr + token.to(tl.int64) * x_stride_token + head * x_stride_head
        exact_low = tl.load(x_row + dims, mask=dim_mask, other=0.0).to(ring_ptr.dtype.element_ty)
        exact_high = tl.load(x_row + HALF + dims, mask=dim_mask, other=0.0).to(ring_ptr.dtype.element_ty)
        for column in tl.static_range(RING_COLUMNS):
            ring_slot = tl.load(ring_slots_ptr + token.to(tl.int64) * ring_slots_stride_token + column).to(tl.int64)
            ring_row = ring_ptr + ring_slot * ring_stride_slot + head * ring_stride_head
            tl.store(ring_row + dims, exact_low, mask=dim_mask)
            tl.store(ring_row + HALF + dims, exact_high, mask=dim_mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    if token > 0:
        previous = tl.load(slot_ptr + token - 1).to(tl.int64)
        if previous >= 0:
            if previous // BLOCK_SIZE == block:
                return                   # not the first token of its run: that token's program writes it
    first = slot - block * BLOCK_SIZE
    # The run: this token and the following ones in the same block (at most a block's worth).
    run = token + tl.arange(0, BS_PAD)
    run_slots = tl.load(slot_ptr + run, mask=run < num_tokens, other=-1).to(tl.int64)
    in_run = (run_slots >= 0) & (run_slots // BLOCK_SIZE == block) & (run < num_tokens)
    rows = run.to(tl.int64)[:, None] * x_stride_token + head * x_stride_head
    mask = in_run[:, None] & dim_mask[None, :]
    x_low = tl.load(x_ptr + rows + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x_high = tl.load(x_ptr + rows + HALF + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    grows = first > 0
    pair_row = scales_ptr + block * scales_stride_block + head * scales_stride_head
    old_scale_low = tl.load(pair_row + dims, mask=dim_mask, other=1.0)
    old_scale_high = tl.load(pair_row + HALF + dims, mask=dim_mask, other=1.0)
    old_zero_low = tl.load(pair_row + scales_stride_pair + dims, mask=dim_mask, other=0.0)
    old_zero_high = tl.load(pair_row + scales_stride_pair + HALF + dims, mask=dim_mask, other=0.0)
    offsets = tl.arange(0, BS_PAD)
    written = offsets < first
    block_rows = payload_ptr + block * payload_stride_block + offsets.to(tl.int64)[:, None] * payload_stride_token \
        + head * payload_stride_head + dims[None, :]
    old_bytes = tl.load(block_rows, mask=written[:, None] & dim_mask[None, :], other=0)
    scale_low, zero_low, codes_low, recoded_low = _channel_half(x_low, old_bytes, in_run, written, grows,
                                                                old_scale_low, old_zero_low, 0)
    scale_high, zero_high, codes_high, recoded_high = _channel_half(x_high, old_bytes, in_run, written, grows,
                                                                    old_scale_high, old_zero_high, 4)
    recoded = recoded_low.to(tl.uint8) | (recoded_high.to(tl.uint8) << 4)
    tl.store(block_rows, recoded, mask=written[:, None] & dim_mask[None, :])
    packed = codes_low.to(tl.uint8) | (codes_high.to(tl.uint8) << 4)
    run_rows = payload_ptr + block * payload_stride_block + ((run_slots - block * BLOCK_SIZE)
                                                             * payload_stride_token)[:, None] \
        + head * payload_stride_head + dims[None, :]
    tl.store(run_rows, packed, mask=mask)
    tl.store(pair_row + dims, scale_low, mask=dim_mask)
    tl.store(pair_row + HALF + dims, scale_high, mask=dim_mask)
    tl.store(pair_row + scales_stride_pair + dims, zero_low, mask=dim_mask)
    tl.store(pair_row + scales_stride_pair + HALF + dims, zero_high, mask=dim_mask)


def supported(cache) -> bool:
    """Whether the kernel handles this QuantizedKVCache's layout (power-of-2 head_dim and groups;
    int4 groups inside one half of the head; per-channel int4 keys: any even head_dim)."""
    head_dim, fmt = cache.head_dim, cache.fmt
    if fmt.per_channel:
        return head_dim % 2 == 0
    group = fmt.group(head_dim)
    if head_dim & (head_dim - 1) or group & (group - 1):
        return False
    if fmt.name == "int4" and not fmt.static_scales:
        return group == head_dim or (head_dim // 2) % group == 0
    return True


def store_quantized(x: torch.Tensor, cache, slot_mapping: torch.Tensor,
                    window_slots: torch.Tensor | None = None) -> None:
    """x [T, kv_heads, head_dim] -> payload (+ scales) of `cache` (a QuantizedKVCache) at slots, and,
    where the part keeps a full-precision ring and `window_slots` [T, columns] is given, into the ring
    at each column's slot (as QuantizedKVCache.store)."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    if x.stride(2) != 1:
        x = x.contiguous()
    fmt, payload, scales = cache.fmt, cache.payload, cache.scales
    num_kv_heads, head_dim = payload.shape[2], cache.head_dim
    if fmt.per_channel:
        _store_channel(x, cache, slot_mapping, window_slots)
        return
    static = cache.static_scale if cache.static_scale is not None else payload
    scales_arg = scales if scales is not None else payload
    ring, ring_slots, ring_strides, ring_columns = payload, slot_mapping, (0, 0, 0), 0
    if cache.window is not None and window_slots is not None:
        ring, ring_slots, ring_columns = cache.window, window_slots, window_slots.shape[1]
        if ring.stride(2) != 1:
            raise ValueError("the window ring needs unit head_dim stride")
        ring_strides = (ring.stride(0), ring.stride(1), window_slots.stride(0))
    _store_quant_kernel[(num_tokens,)](
        x, payload, scales_arg, static, slot_mapping, ring, ring_slots,
        x.stride(0), x.stride(1), payload.stride(1), payload.stride(2),
        scales.stride(1) if scales is not None else 0, scales.stride(2) if scales is not None else 0, *ring_strides,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_power_of_2(num_kv_heads),
        FORMAT=FORMAT_CODES[fmt.name], QMAX=fmt.qmax, GROUP=fmt.group(head_dim), STATIC=fmt.static_scales,
        RING_COLUMNS=ring_columns, num_warps=max(1, min(8, next_power_of_2(num_kv_heads) * head_dim // 256)))


def _store_channel(x: torch.Tensor, cache, slot_mapping: torch.Tensor, window_slots: torch.Tensor | None) -> None:
    payload, scales = cache.payload, cache.scales
    num_blocks, block_size, num_kv_heads, _ = payload.shape
    ring, ring_slots, ring_strides, ring_columns = payload, slot_mapping, (0, 0, 0), 0
    if cache.window is not None and window_slots is not None:
        ring, ring_slots, ring_columns = cache.window, window_slots, window_slots.shape[1]
        if ring.stride(2) != 1:
            raise ValueError("the window ring needs unit head_dim stride")
        ring_strides = (ring.stride(0), ring.stride(1), window_slots.stride(0))
    if payload.stride(3) != 1 or scales.stride(3) != 1:
        raise ValueError("per-channel key parts need unit head_dim strides")
    num_tokens = x.shape[0]
    half_pad = next_power_of_2(cache.head_dim // 2)
    _store_channel_kernel[(num_tokens, num_kv_heads)](
        x, payload, scales, slot_mapping, ring, ring_slots, num_tokens, x.stride(0), x.stride(1),
        *payload.stride()[:3], scales.stride(0), scales.stride(1), scales.stride(2), *ring_strides,
        HEAD_DIM=cache.head_dim, HALF_PAD=half_pad, BLOCK_SIZE=block_size, BS_PAD=next_power_of_2(block_size),
        RING_COLUMNS=ring_columns, num_warps=max(1, min(4, next_power_of_2(block_size) * half_pad // 256)))

"""One quantized part (K or V) of one layer's paged cache: its device tensors, and the torch reference
of quantize-on-store and dequantize-on-gather (the Triton kernels in kvserve/kernels/triton/ match it).

A quantized part can keep a full-precision *window*: the first `sinks` tokens of a sequence and
its most recent `window` tokens, in a ring of `sinks + window` rows per running sequence. Every
token is also quantized into the paged cache when it is written, so nothing moves when a token
leaves the window; reads take the full-precision copy where the ring holds one. Keeping the sink
tokens exact is what stops the collapse seen when attention-sink tokens are quantized (transformers
issue 35185). The ring costs `rows * (sinks + window)` full-precision tokens, allocated once.

Optional error feedback carries each token's quantization residual (in fp32, per running sequence,
KV head and channel) into the next token's quantization of the same channel.

Keys per channel (`fmt.per_channel`, the int4 default): each block holds one (scale, zero) pair per
KV head and channel, over the tokens written into it so far. A write of tokens into a block (one
decode token, or a prefill chunk's run of tokens in the block) widens the block's range [zero,
zero + 15 * scale] to take them; when that changes the pair, the block's earlier codes are decoded
with the old pair and encoded with the new one (requantize-on-grow). A write at offset 0 starts the
block afresh, so a reused block needs no clearing. The state is all in the block, so no per-sequence
memory is needed and prefix caching and block copies work as for any block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kvstore.formats import (CHANNEL_LEVELS, KVFormat, channel_scale_zero, dequantize, dequantize_channel,
                                     encode_channel, pack_nibbles, quantize, unpack_nibbles)


@dataclass
class QuantizedKVCache:
    """Device tensors of one quantized part (K or V) of one layer.

    payload [num_blocks, block_size, kv_heads, width]; scales [num_blocks, block_size, kv_heads,
    groups] fp16 (None with static scales; per channel: [num_blocks, kv_heads, 2, head_dim], the
    scale and zero rows of each block and head); static_scale [kv_heads, head_dim] fp32; window
    [rows * (sinks + window) + 1, kv_heads, head_dim] in the model dtype (the last row takes writes
    that must be dropped, so a store never branches); residual [rows + 1, kv_heads, head_dim] fp32.
    """

    fmt: KVFormat
    payload: torch.Tensor
    scales: torch.Tensor | None
    head_dim: int
    dtype: torch.dtype                           # the model dtype reads dequantize to
    static_scale: torch.Tensor | None = None
    window_size: int = 0
    num_sinks: int = 0
    window: torch.Tensor | None = None
    residual: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical cache shape [num_blocks, block_size, kv_heads, head_dim]."""
        num_blocks, block_size, num_kv_heads, _ = self.payload.shape
        return num_blocks, block_size, num_kv_heads, self.head_dim

    @property
    def ring_len(self) -> int:
        return self.num_sinks + self.window_size

    # reference store: quantize on write
    def store(self, x: torch.Tensor, slot_mapping: torch.Tensor, window_slots: torch.Tensor | None = None,
              residual_rows: torch.Tensor | None = None) -> None:
        """x [T, kv_heads, head_dim] -> slots (and the full-precision ring at `window_slots`, which
        holds each token's ring row; the trash row for tokens the ring does not keep)."""
        num_kv_heads = x.shape[1]
        if self.fmt.per_channel:
            if self.residual is not None:
                raise ValueError("error feedback is implemented for per-token scales only")
            self._store_channel(x, slot_mapping)
        else:
            if self.residual is not None and residual_rows is not None:
                codes, scales = self._quantize_with_feedback(x, residual_rows)
            else:
                codes, scales = quantize(self.fmt, x, self.static_scale)
            self.payload.view(-1, num_kv_heads, codes.shape[-1]).index_copy_(0, slot_mapping, codes)
            if scales is not None:
                self.scales.view(-1, num_kv_heads, scales.shape[-1]).index_copy_(0, slot_mapping, scales)
        if self.window is not None and window_slots is not None:
            for column in range(window_slots.shape[1]):
                self.window.index_copy_(0, window_slots[:, column], x.to(self.window.dtype))

    def _store_channel(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Per-channel store (requantize-on-grow). The tokens of one block must be consecutive in
        `x` (a step's tokens of one sequence are), in position order, and no block may take two runs
        of tokens in one call. The run count is read on the host: this reference is for the CPU and
        for checking the Triton store, which runs on CUDA."""
        num_tokens, num_kv_heads, _ = x.shape
        if num_tokens == 0:
            return
        block_size = self.payload.shape[1]
        x32 = x.float()
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        offsets = slot_mapping - blocks * block_size
        starts = torch.ones(num_tokens, dtype=torch.bool, device=x.device)
        starts[1:] = blocks[1:] != blocks[:-1]
        run = torch.cumsum(starts.long(), 0) - 1
        run_block, run_first = blocks[starts], offsets[starts]
        num_runs = run_block.shape[0]
        index = run[:, None, None].expand_as(x32)
        low = torch.full((num_runs, *x32.shape[1:]), float("inf"), device=x.device).scatter_reduce(
            0, index, x32, "amin")
        high = torch.full_like(low, float("-inf")).scatter_reduce(0, index, x32, "amax")
        state = self.scales[run_block]                                       # [runs, heads, 2, head_dim]
        old_scale, old_zero = state[:, :, 0], state[:, :, 1]
        old_low, old_high = old_zero.float(), old_zero.float() + CHANNEL_LEVELS * old_scale.float()
        grows = (run_first > 0)[:, None, None]                               # the block holds tokens
        scale, zero = channel_scale_zero(torch.where(grows, torch.minimum(low, old_low), low),
                                         torch.where(grows, torch.maximum(high, old_high), high))
        # Channels whose range takes the new tokens keep their pair (recomputing it from the stored
        # pair could round it elsewhere); the others' codes already in the block are decoded with the
        # old pair and encoded with the new one.
        widened = (low < old_low) | (high > old_high)
        scale = torch.where(grows & ~widened, old_scale, scale)
        zero = torch.where(grows & ~widened, old_zero, zero)
        old_payload = self.payload[run_block]                                # [runs, block, heads, width]
        old_codes = unpack_nibbles(old_payload)
        values = old_codes * old_scale.float()[:, None] + old_low[:, None]
        recoded = torch.where((grows & widened)[:, None], encode_channel(values, scale[:, None], zero[:, None]),
                              old_codes)
        written = torch.arange(block_size, device=x.device)[None, :] < run_first[:, None]
        self.payload[run_block] = torch.where(written[:, :, None, None], pack_nibbles(recoded), old_payload)
        codes = pack_nibbles(encode_channel(x32, scale[run], zero[run]))
        self.payload.view(-1, num_kv_heads, codes.shape[-1]).index_copy_(0, slot_mapping, codes)
        self.scales[run_block] = torch.stack((scale, zero), dim=2)

    def _quantize_with_feedback(self, x: torch.Tensor, rows: torch.Tensor):
        """Sequential over tokens: a token's residual feeds the next token of the same sequence.
        Tokens of one sequence are consecutive in a step, so this loops once per token (a decode
        step is one batched call over its rows)."""
        codes_out, scales_out = [], []
        x32 = x.float()
        # Decode tokens (distinct rows) first as one batch; then prefill tokens one at a time.
        rows_list = rows.tolist()
        start = 0
        while start < len(rows_list):
            end = start + 1
            seen = {rows_list[start]}
            while end < len(rows_list) and rows_list[end] not in seen:
                seen.add(rows_list[end])
                end += 1
            index = rows[start:end]
            target = x32[start:end] + self.residual[index]
            codes, scales = quantize(self.fmt, target, self.static_scale)
            rebuilt = dequantize(self.fmt, codes, scales, torch.float32, self.static_scale)
            self.residual[index] = target - rebuilt
            codes_out.append(codes)
            if scales is not None:
                scales_out.append(scales)
            start = end
        return torch.cat(codes_out), (torch.cat(scales_out) if scales_out else None)

    # reference gathers: dequantize on read
    def gather_blocks(self, block_tables: torch.Tensor) -> torch.Tensor:
        """Whole blocks of each row's table -> [B, max_blocks * block_size, kv_heads, head_dim]."""
        batch, max_blocks = block_tables.shape
        flat = block_tables.reshape(-1)
        payload = self.payload.index_select(0, flat)
        scales = self.scales.index_select(0, flat) if self.scales is not None else None
        if self.fmt.per_channel:
            values = dequantize_channel(payload, scales[:, None, :, 0], scales[:, None, :, 1], self.dtype)
        else:
            values = dequantize(self.fmt, payload, scales, self.dtype, self.static_scale)
        return values.view(batch, max_blocks * self.payload.shape[1], *values.shape[2:])

    def gather_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Tokens at `slots` [C] -> [C, kv_heads, head_dim]."""
        num_kv_heads = self.payload.shape[2]
        payload = self.payload.view(-1, num_kv_heads, self.payload.shape[3])[slots]
        if self.fmt.per_channel:
            scales = self.scales[torch.div(slots, self.payload.shape[1], rounding_mode="floor")]
            return dequantize_channel(payload, scales[:, :, 0], scales[:, :, 1], self.dtype)
        scales = None
        if self.scales is not None:
            scales = self.scales.view(-1, num_kv_heads, self.scales.shape[3])[slots]
        return dequantize(self.fmt, payload, scales, self.dtype, self.static_scale)

    def overlay_window(self, values: torch.Tensor, rows: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """values [B, L, kv_heads, head_dim] (position-indexed) with the ring's full-precision copies
        put in place of the sink positions and the last `window_size` positions of each row."""
        if self.window is None:
            return values
        batch, length = values.shape[:2]
        positions = torch.arange(length, device=values.device)[None, :]
        lens = context_lens.to(positions.dtype)[:, None]
        ring_index, use_ring = ring_lookup(positions, lens, self.num_sinks, self.window_size)
        flat_index = rows.to(positions.dtype)[:, None] * self.ring_len + ring_index
        flat_index = torch.where(use_ring, flat_index, torch.zeros_like(flat_index))
        exact = self.window[flat_index.reshape(-1)].view(batch, length, *values.shape[2:])
        return torch.where(use_ring[..., None, None], exact.to(values.dtype), values)


def ring_lookup(positions: torch.Tensor, context_lens: torch.Tensor, num_sinks: int,
                window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index in a sequence's ring, whether the ring holds the position) for positions < context_lens."""
    in_sink = positions < num_sinks
    in_window = positions >= context_lens - window if window else torch.zeros_like(in_sink)
    use_ring = (in_sink | in_window) & (positions < context_lens)
    ring_index = torch.where(in_sink, positions, num_sinks + (positions % window if window else 0))
    return ring_index, use_ring



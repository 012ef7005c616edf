"""Torch reference of attention over a quantized paged KV cache (kvserve.kvstore).

A layer's cache part is either a plain tensor (full precision, stored as in kernels.reference) or a
QuantizedKVCache; the two parts of a layer may differ (keys int8, values fp8, ...). Reads gather
payload + scales, dequantize to the query dtype, put the full-precision window's copies in place,
then run the same SDPA as the full-precision reference. The Triton kernels must match these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels import reference
from kvserve.kvstore import QuantizedKVCache


def store_part(cache, x: torch.Tensor, slot_mapping: torch.Tensor, window_slots: torch.Tensor | None = None,
               rows: torch.Tensor | None = None) -> None:
    """New tokens' K or V [T, kv_heads, head_dim] -> their slots (quantized on write)."""
    if isinstance(cache, QuantizedKVCache):
        cache.store(x, slot_mapping, window_slots, rows)
        return
    num_kv_heads, head_dim = cache.shape[-2:]
    cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x.to(cache.dtype))


def gather_blocks_part(cache, block_tables: torch.Tensor, rows: torch.Tensor | None,
                       context_lens: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks -> [B, max_blocks * block_size, kv_heads, head_dim] in `dtype`, window overlaid."""
    if not isinstance(cache, QuantizedKVCache):
        batch, max_blocks = block_tables.shape
        _, block_size, num_kv_heads, head_dim = cache.shape
        gathered = cache.index_select(0, block_tables.reshape(-1))
        return gathered.view(batch, max_blocks * block_size, num_kv_heads, head_dim).to(dtype)
    values = cache.gather_blocks(block_tables).to(dtype)
    if cache.window is not None and rows is not None:
        values = cache.overlay_window(values, rows, context_lens)
    return values


def gather_slots_part(cache, slots: torch.Tensor, row: int, dtype: torch.dtype) -> torch.Tensor:
    """A context's tokens [C] -> [C, kv_heads, head_dim] in `dtype`, window overlaid."""
    if not isinstance(cache, QuantizedKVCache):
        num_kv_heads, head_dim = cache.shape[-2:]
        return cache.view(-1, num_kv_heads, head_dim)[slots].to(dtype)
    values = cache.gather_slots(slots).to(dtype)
    if cache.window is not None and row >= 0:
        context_len = torch.tensor([slots.shape[0]], device=slots.device)
        rows = torch.tensor([row], device=slots.device)
        values = cache.overlay_window(values[None], rows, context_len)[0]
    return values


def paged_decode_attention(query: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, heads, D] over each row's paged context -> [B, heads, D]; a row of length 0 gives
    zeros (CUDA-graph padding rows), as the kernels do."""
    batch, num_heads, head_dim = query.shape
    keys = gather_blocks_part(k_cache, block_tables, rows, context_lens, query.dtype).transpose(1, 2)
    values = gather_blocks_part(v_cache, block_tables, rows, context_lens, query.dtype).transpose(1, 2)
    num_kv_heads, length = keys.shape[1], keys.shape[2]
    mask = torch.arange(length, device=query.device)[None, :] < context_lens.to(query.device)[:, None]
    grouped = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    out = torch.where((context_lens > 0).to(out.device)[:, None, None, None], out, torch.zeros_like(out))
    return out.reshape(batch, num_heads, head_dim)


def paged_prefill_attention(query: torch.Tensor, k_cache, v_cache, context_slots: torch.Tensor,
                            scale: float, row: int = -1) -> torch.Tensor:
    """A chunk of Q queries, the last Q of a C-token cached context: query i sees positions <= C-Q+i."""
    keys = gather_slots_part(k_cache, context_slots, row, query.dtype)
    values = gather_slots_part(v_cache, context_slots, row, query.dtype)
    return reference.context_attention(query, keys, values, scale)

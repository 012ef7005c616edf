"""Torch reference of every attention kernel: paged KV store and paged attention.

These run on CPU and GPU and define what a fast kernel must compute. The paged cache layout is
NHD per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`, so a token's slot is
`block_id * block_size + offset` and `cache.view(-1, num_kv_heads, head_dim)[slot]` is its vector.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes new tokens' K/V ([T, kv_heads, head_dim]) into their slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Cache vectors at `slots` (any shape S) -> [*S, kv_heads, head_dim]."""
    num_kv_heads, head_dim = cache.shape[-2:]
    return cache.view(-1, num_kv_heads, head_dim)[slots]


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Whole blocks of each row's table -> [B, max_blocks * block_size, kv_heads, head_dim].

    Copying whole blocks (block_size * kv_heads * head_dim contiguous elements) is several times
    faster than gathering token by token, most of all on CPU.
    """
    batch, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, block_tables.reshape(-1))
    return gathered.view(batch, max_blocks * block_size, num_kv_heads, head_dim)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence over its paged context.

    query [B, heads, D]; block_tables [B, max_blocks] (int64, padding any valid block);
    context_mask [B, max_blocks * block_size] bool, True where a position holds context.
    Returns [B, heads, D]. The query heads of a GQA group are folded into SDPA's query-length axis
    against their one KV head, so K/V are read once per KV head and never expanded (SDPA's own GQA
    path with a mask expands them: 7x the bytes for a 28/4-head model). The gathered cache is
    passed as a strided [B, kv_heads, L, D] view, not copied again; on CPU this is faster than two
    batched matmuls over permuted copies (measured: docs/cpu_performance.md#history).
    """
    batch, num_heads, head_dim = query.shape
    keys = gather_blocks(k_cache, block_tables).transpose(1, 2).to(query.dtype)     # [B, kvh, L, D]
    values = gather_blocks(v_cache, block_tables).transpose(1, 2).to(query.dtype)
    num_kv_heads = keys.shape[1]
    grouped = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=context_mask[:, None, None, :],
                                         scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of a prompt chunk that has no cached prefix: q/k/v [T, heads, D]."""
    return context_attention(query, key, value, scale)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            context_slots: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk of Q query tokens that are the last Q of a C-token context already in the cache.

    query [Q, heads, D]; context_slots [C]. Query i sees context positions <= C - Q + i.
    """
    keys = gather_kv(k_cache, context_slots).to(query.dtype)
    values = gather_kv(v_cache, context_slots).to(query.dtype)
    return context_attention(query, keys, values, scale)


def context_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """query [Q, heads, D], the last Q positions of keys/values [C, kv_heads, D] -> [Q, heads, D];
    query i sees positions <= C - Q + i (causal, aligned to the bottom right).

    The causal bias object, not a materialized [Q, C] mask, so that SDPA keeps its fused kernels
    (flash / memory-efficient on CUDA): with a boolean mask it falls back to the math path, which
    writes the [heads, Q, C] scores to memory (a 2k-token chunk over a 16k context: 3.7 GB per layer
    for Qwen-7B)."""
    from torch.nn.attention.bias import causal_lower_right
    num_queries, context_len = query.shape[0], keys.shape[0]
    mask = None if num_queries == context_len else causal_lower_right(num_queries, context_len)
    out = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                         values.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)

"""Per-block key summaries and the attention bounds they give (Quest's page criticality).

A block's summary is, per layer and KV head, the per-channel minimum and maximum of its keys. For a
query q, sum_c max(q_c * min_c, q_c * max_c) is an upper bound of q . k over every key k of the
block, so a block whose bound is low cannot hold a token the query attends to much. The tiering
mode of the presses (engine/kv_tiering.py) keeps these summaries on the device for every full block
of a tiered request, the ones demoted to the host tier included, and ranks blocks by them on the
current decode query to decide which to bring back.
"""

from __future__ import annotations

import torch

from kvserve.kvstore import KVCacheStore
from kvserve.worker.press_apply import read_slots


def block_key_summaries(kv_store: KVCacheStore, block_ids: list[int]) -> torch.Tensor:
    """[n, layers, kv_heads, 2, head_dim] (min, max) of the keys of the given device blocks, in the
    model's dtype (dequantized for a quantized format)."""
    bs = kv_store.block_size
    blocks = torch.as_tensor(block_ids, dtype=torch.long)
    slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1).to(kv_store.device)
    out = []
    for key_part, _value_part in kv_store:
        keys = read_slots(key_part, slots).view(len(block_ids), bs, *key_part.shape[2:])  # [n, bs, H, D]
        out.append(torch.stack((keys.amin(dim=1), keys.amax(dim=1)), dim=2))               # [n, H, 2, D]
    return torch.stack(out, dim=1).to(kv_store.spec.model_dtype)


def block_bounds(queries: list[torch.Tensor] | torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """[layers, heads, n] fp32: per layer and query head, the upper bound of q . k over each block's keys.

    queries: per layer [heads, head_dim] (one decode query, RoPE applied), or those stacked;
    summaries as `block_key_summaries` gives them. Query heads share their KV head's summary (GQA).
    max(q_c * min_c, q_c * max_c) is min(q_c, 0) * min_c + max(q_c, 0) * max_c, so the bound is one
    batched matrix product over (layer, KV head) of the summaries' (min, max) rows with the query's
    (negative, positive) parts: the summaries are read once, in their own dtype."""
    n, num_layers, kv_heads, _, dim = summaries.shape
    q = queries if isinstance(queries, torch.Tensor) else torch.stack(list(queries))
    group = q.shape[1] // kv_heads
    q = q.float().view(num_layers * kv_heads, group, dim)
    parts = torch.cat((q.clamp(max=0), q.clamp(min=0)), dim=-1)                 # [L*H, G, 2D]: (min, max)
    rows = summaries.reshape(n, num_layers * kv_heads, 2 * dim).transpose(0, 1)   # [L*H, n, 2D]
    bounds = torch.bmm(rows, parts.to(rows.dtype).transpose(1, 2))              # [L*H, n, G]
    return bounds.float().view(num_layers, kv_heads, n, group).transpose(2, 3).reshape(num_layers, -1, n)


def block_row_ranks(scores: torch.Tensor) -> torch.Tensor:
    """[rows, n] int64: each block's place in every (layer, head) row of `scores` [layers, heads, n],
    highest first (0: the row's highest; ties go to the earlier block)."""
    n = scores.shape[-1]
    flat = scores.reshape(-1, n)
    order = torch.argsort(flat, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(n, device=scores.device).expand_as(order))
    return ranks


def block_votes(scores: torch.Tensor, count: int) -> torch.Tensor:
    """[n] float: for how many (layer, head) rows of `scores` [layers, heads, n] each block is among
    the row's `count` highest (ties go to the earlier block)."""
    return (block_row_ranks(scores) < max(0, count)).sum(dim=0).float()


def block_best_ranks(scores: torch.Tensor) -> torch.Tensor:
    """[n] int64: each block's best rank over the (layer, head) rows of `scores` [layers, heads, n]
    (0: the highest of some row; ties go to the earlier block)."""
    return block_row_ranks(scores).min(dim=0).values

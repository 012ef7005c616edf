"""Quest's block bounds against loops over the keys: the summary is each block's per-channel min and
max, the bound is at least every key's logit and equals the loop's formula, and the rankings
(best rank over rows, votes within a budget) match hand-written loops."""

from __future__ import annotations

import pytest
import torch

from kvserve.kvstore import KVCacheStore, build_kv_cache_spec
from kvserve.worker.key_summaries import block_best_ranks, block_bounds, block_key_summaries, block_votes

BLOCK = 4


def _store(layers: int, kv_heads: int, head_dim: int, blocks: int) -> KVCacheStore:
    spec = build_kv_cache_spec(layers, kv_heads, head_dim, torch.float32)
    return KVCacheStore.allocate(spec, blocks, BLOCK, "cpu")


@pytest.mark.parametrize("kv_heads,heads", [(2, 2), (2, 6)])
def test_bounds_hold_every_key_and_match_the_loop(kv_heads, heads):
    torch.manual_seed(0)
    layers, dim, blocks = 3, 8, 6
    store = _store(layers, kv_heads, dim, blocks)
    for key, value in store:
        key.copy_(torch.randn_like(key))
        value.copy_(torch.randn_like(value))
    ids = [4, 1, 3]
    summaries = block_key_summaries(store, ids)
    assert summaries.shape == (3, layers, kv_heads, 2, dim)
    queries = [torch.randn(heads, dim) for _ in range(layers)]
    bounds = block_bounds(queries, summaries)
    group = heads // kv_heads
    for layer in range(layers):
        keys = store[layer].key
        for row, block in enumerate(ids):
            for head in range(heads):
                k = keys[block, :, head // group]                          # [BLOCK, dim]
                low, high = k.min(dim=0).values, k.max(dim=0).values
                q = queries[layer][head]
                expected = sum(max(q[c] * low[c], q[c] * high[c]) for c in range(dim))
                assert bounds[layer, head, row] == pytest.approx(float(expected), rel=1e-5, abs=1e-5)
                assert bounds[layer, head, row] >= float((k @ q).max()) - 1e-5


def test_best_ranks_and_votes_match_loops():
    torch.manual_seed(1)
    scores = torch.randn(2, 3, 7)
    best = block_best_ranks(scores)
    votes = block_votes(scores, 2)
    rows = scores.reshape(-1, 7)
    for block in range(7):
        ranks = [sorted(range(7), key=lambda b: -float(row[b])).index(block) for row in rows]
        assert int(best[block]) == min(ranks)
        assert float(votes[block]) == sum(rank < 2 for rank in ranks)
    assert float(votes.sum()) == 2 * rows.shape[0]
    assert block_votes(scores, 0).sum() == 0

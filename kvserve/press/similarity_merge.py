"""Similarity merge: runs of consecutive tokens whose keys barely change carry little new
information, so instead of dropping tokens, fold each removed token into the kept token before it.
In the spirit of merging presses (CaM, D2O, KVMerger): nothing is simply dropped (unless `threshold`
says a token is too unlike its neighbour to be averaged in), so a removed token's share of attention
still lands on a key close to its own.

Per KV head, a token's novelty is 1 - cos(its key, the previous token's key) (the first token:
above every novelty, it is always kept). The `keep` most novel tokens are kept (keep_top's order
and tie rule). Every removed token belongs to the group of the nearest kept token before it (its
leader); the leader's key and value become the means of its group's keys and values, each original
token weighing 1 (a group of m tokens averages m). `kept` holds the leaders' indices.

`threshold` (0: off) only decides merge against drop, never how many tokens are kept (every head
must keep exactly `keep`): with threshold > 0, a removed token whose cosine similarity to the
previous token is below the threshold is dropped instead of merged, so it does not drag its
leader's key towards an unrelated one. Which tokens are removed is the same for every threshold:
the least novel, i.e. the most similar to their predecessor, so the merge candidates (similarity
>= threshold) go first and the least similar of the rest are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvserve.press.base import Compressed, PressInputs, keep_top

FIRST = 3.0     # the first token's score: novelty lies in [0, 2]


@dataclass(frozen=True)
class SimilarityMergePress:
    name: ClassVar[str] = "similarity_merge"
    needs_queries: ClassVar[bool] = False

    threshold: float = 0.0   # 0: merge every removed token; > 0: drop those with cos to previous < it

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"{self.name}: threshold must be in [0, 1], got {self.threshold}")

    def similarity(self, inputs: PressInputs) -> torch.Tensor:
        """[kv_heads, T - 1]: cos(key t, key t - 1) for t = 1 .. T - 1, per KV head."""
        keys = inputs.keys.float()
        return F.cosine_similarity(keys[1:], keys[:-1], dim=-1).t()

    def score(self, inputs: PressInputs) -> torch.Tensor:
        """[kv_heads, T] novelty, 1 - cos to the previous key; the first token FIRST."""
        novelty = 1.0 - self.similarity(inputs)
        return torch.cat([novelty.new_full((novelty.shape[0], 1), FIRST), novelty], dim=-1)

    def compress(self, inputs: PressInputs, keep: int) -> Compressed:
        kept = keep_top(inputs, self.score(inputs), keep).kept                    # [kv_heads, keep]
        kv_heads, t = inputs.num_kv_heads, inputs.num_tokens
        is_kept = torch.zeros(kv_heads, t, dtype=torch.bool, device=kept.device)
        is_kept.scatter_(1, kept, True)
        # The first token is always kept, so every token has a leader: its slot is the number of
        # kept tokens at or before it, minus one.
        slot = is_kept.cumsum(dim=1) - 1                                          # [kv_heads, T]
        weight = torch.ones(kv_heads, t, dtype=torch.float32, device=kept.device)
        if self.threshold > 0:
            similar = self.similarity(inputs) >= self.threshold                  # [kv_heads, T - 1]
            merged = torch.cat([is_kept[:, :1], is_kept[:, 1:] | similar], dim=1)
            weight = weight * merged
        index = slot[:, :, None].expand(kv_heads, t, inputs.keys.shape[-1])

        def group_mean(x: torch.Tensor) -> torch.Tensor:
            x = x.float().permute(1, 0, 2) * weight[:, :, None]                   # [kv_heads, T, D]
            total = x.new_zeros(kv_heads, keep, x.shape[-1]).scatter_add_(1, index, x)
            count = weight.new_zeros(kv_heads, keep).scatter_add_(1, slot, weight)
            return (total / count[:, :, None]).permute(1, 0, 2).contiguous()      # [keep, kv_heads, D]

        return Compressed(group_mean(inputs.keys), group_mean(inputs.values), kept)

"""What a press sees and returns: one layer's prunable KV of one request, and the tokens each KV head
keeps.

A press works on dense tensors of one layer at a time (the engine gathers them from the paged cache,
dequantized, and writes the kept tokens back compacted; kvserve/press/compaction.py). Every KV head
keeps the same number of tokens, so the request's blocks shrink by the same count in every layer and
head; which tokens a head keeps is its own choice (RoPE is already in the keys, so slot i of one head
may hold another original token than slot i of the next head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Protocol

import torch


@dataclass(frozen=True)
class PressInputs:
    """One layer's prunable region of one request (positions `start` .. `start + T - 1`).

    keys, values: [T, kv_heads, head_dim], float32, keys with RoPE applied (as cached).
    queries: [W, heads, head_dim] float32 with RoPE, the request's last W tokens' queries in this
        layer (the observation window; its tokens are the region's last W), or None when the press
        does not need them (`needs_queries` False) or none were observed.
    scale: the attention's softmax scale (head_dim ** -0.5 for these models).
    """
    keys: torch.Tensor
    values: torch.Tensor
    queries: Optional[torch.Tensor]
    scale: float
    layer: int = 0

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]


@dataclass(frozen=True)
class Compressed:
    """What one layer keeps: keys/values [N, kv_heads, head_dim] (slot i of head h is the i-th token
    head h keeps), and `kept` [kv_heads, N] (int64), the region index of each kept token (for a
    merge, the index of the token the merged group is kept at). Kept tokens are in original order
    within each head."""
    keys: torch.Tensor
    values: torch.Tensor
    kept: torch.Tensor


class Press(Protocol):
    name: ClassVar[str]
    needs_queries: ClassVar[bool]      # whether `score` reads `PressInputs.queries`

    def score(self, inputs: PressInputs) -> torch.Tensor:
        """[kv_heads, T] float32: higher is kept first."""
        ...

    def compress(self, inputs: PressInputs, keep: int) -> Compressed:
        """The `keep` tokens (per KV head) this press keeps, gathered; 1 <= keep <= T."""
        ...


def keep_top(inputs: PressInputs, scores: torch.Tensor, keep: int) -> Compressed:
    """The default `compress`: each head's `keep` best-scored tokens, in original order (ties go to
    the earlier token, so equal scores keep the same tokens on every run)."""
    ranked = torch.argsort(scores, dim=-1, descending=True, stable=True)     # stable: ties keep the earlier
    kept = ranked[:, :keep].sort(dim=-1).values                               # [kv_heads, keep]
    heads = torch.arange(inputs.num_kv_heads, device=kept.device)[:, None]
    keys = inputs.keys.permute(1, 0, 2)[heads, kept].permute(1, 0, 2)        # [keep, kv_heads, D]
    values = inputs.values.permute(1, 0, 2)[heads, kept].permute(1, 0, 2)
    return Compressed(keys.contiguous(), values.contiguous(), kept)

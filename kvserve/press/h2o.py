"""H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference"): the tokens
that have drawn the most attention so far (the heavy hitters) keep drawing it, so keep those with
the largest attention accumulated (summed) over the observed queries, plus the most recent tokens.
Unlike SnapKV there is no pooling, and the window's tokens compete like any other unless they fall
within `recent`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvserve.press.base import Compressed, PressInputs, keep_top
from kvserve.press.snapkv import keep_tail, window_attention


@dataclass(frozen=True)
class H2OPress:
    name: ClassVar[str] = "h2o"
    needs_queries: ClassVar[bool] = True

    recent: int = 0     # most recent tokens always kept; 0: the observation window's W

    def __post_init__(self) -> None:
        if self.recent < 0:
            raise ValueError(f"{self.name}: recent must be >= 0, got {self.recent}")

    def score(self, inputs: PressInputs) -> torch.Tensor:
        """Per KV head, the sum over the window's queries of their causal attention probabilities,
        averaged over the group's query heads; the last `recent` tokens (W when 0) score above all,
        the later one higher."""
        probs = window_attention(inputs, self.name)                              # [kv_heads, g, W, T]
        w = probs.shape[2]
        # Summed over W queries, a token's score is at most W.
        return keep_tail(probs.sum(dim=2).mean(dim=1), self.recent or w, float(w))

    def compress(self, inputs: PressInputs, keep: int) -> Compressed:
        return keep_top(inputs, self.score(inputs), keep)

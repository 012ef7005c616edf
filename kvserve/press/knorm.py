"""Knorm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"):
a key with a small L2 norm tends to draw much attention, so keep the keys with the smallest norms.
Needs nothing but the keys, hence works without observed queries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvserve.press.base import Compressed, PressInputs, keep_top


@dataclass(frozen=True)
class KnormPress:
    name: ClassVar[str] = "knorm"
    needs_queries: ClassVar[bool] = False

    def score(self, inputs: PressInputs) -> torch.Tensor:
        """Minus each key's L2 norm, per KV head: the smallest norms are kept."""
        return -torch.linalg.vector_norm(inputs.keys.float(), dim=-1).t().contiguous()

    def compress(self, inputs: PressInputs, keep: int) -> Compressed:
        return keep_top(inputs, self.score(inputs), keep)

"""TOVA (Oren et al., "Transformers are Multi-State RNNs"): the last token's attention decides;
keep the tokens it attends to most. Only the last query is read (the rest of the window is not
needed), and it sees the whole region, so no causal mask is involved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvserve.press.base import Compressed, PressInputs, keep_top
from kvserve.press.snapkv import grouped_queries, keep_tail


@dataclass(frozen=True)
class TOVAPress:
    name: ClassVar[str] = "tova"
    needs_queries: ClassVar[bool] = True

    def score(self, inputs: PressInputs) -> torch.Tensor:
        """Per KV head, the last query's attention probabilities over all the region's keys
        (softmax over the region), averaged over the group's query heads; the last token itself
        scores above all (it is the query's own token, which the next step attends to anyway)."""
        last = grouped_queries(inputs, self.name)[:, :, -1]                      # [kv_heads, group, D]
        logits = torch.einsum("hgd,thd->hgt", last * inputs.scale, inputs.keys.float())
        return keep_tail(torch.softmax(logits, dim=-1).mean(dim=1), 1, 1.0)

    def compress(self, inputs: PressInputs, keep: int) -> Compressed:
        return keep_top(inputs, self.score(inputs), keep)

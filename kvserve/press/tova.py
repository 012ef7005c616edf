"""TOVA (Oren et al., "Transformers are Multi-State RNNs"): the last token's attention decides;
keep the tokens it attends to most. Only the last query is read (the rest of the window is not
needed), and it sees the whole region, so no causal mask is involved. As in the paper (and
kvpress), the probabilities are averaged over all of the layer's heads, so every head keeps the same
tokens: per-KV-head choices followed one head's noise on the default model's passkey test
(benchmarks/kv/press_fidelity.py)."""

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
        """The last query's attention probabilities over all the region's keys (softmax over the
        region), averaged over every query head of the layer and given to each KV head; the last
        token itself scores above all (it is the query's own token, which the next step attends to
        anyway)."""
        last = grouped_queries(inputs, self.name)[:, :, -1]                      # [kv_heads, group, D]
        logits = torch.einsum("hgd,thd->hgt", last * inputs.scale, inputs.keys.float())
        mean = torch.softmax(logits, dim=-1).mean(dim=(0, 1))                    # [T]
        return keep_tail(mean.expand(inputs.num_kv_heads, -1).contiguous(), 1, 1.0)

    def compress(self, inputs: PressInputs, keep: int) -> Compressed:
        return keep_top(inputs, self.score(inputs), keep)

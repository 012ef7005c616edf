"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks"): keep the
first few tokens, which soak up attention whatever the content (the sinks), and a window of the most
recent ones; everything in between goes. It reads neither queries nor keys, so every head keeps the
same tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvserve.press.base import Compressed, PressInputs, keep_top


@dataclass(frozen=True)
class StreamingLLMPress:
    name: ClassVar[str] = "streaming_llm"
    needs_queries: ClassVar[bool] = False

    sinks: int = 4      # leading tokens always kept first (the attention sinks)

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"{self.name}: sinks must be >= 0, got {self.sinks}")

    def score(self, inputs: PressInputs) -> torch.Tensor:
        """Sinks above everything (the earlier one higher, so keep < sinks keeps the first `keep`),
        then recency: keep_top keeps the min(sinks, keep) first tokens and the keep - sinks last."""
        t = inputs.num_tokens
        position = torch.arange(t, device=inputs.keys.device, dtype=torch.float32)
        # 2T - i > T > any position: exact in float32 for every context length we serve.
        scores = torch.where(position < self.sinks, 2 * t - position, position)
        return scores.expand(inputs.num_kv_heads, t).contiguous()

    def compress(self, inputs: PressInputs, keep: int) -> Compressed:
        return keep_top(inputs, self.score(inputs), keep)

"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation"): the last W
tokens of the prompt (the observation window) already attend to what generation will need, so keep
the tokens they attend to most, smoothed along the sequence so that a kept token brings its
neighbours (a phrase, not a lone subword), and the window itself.

Also home of the attention helpers that the other query-reading presses (tova.py, h2o.py) share:
the window's queries grouped by KV head, their causal attention probabilities over the region, and
the tail protection that always keeps the most recent tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvserve.press.base import Compressed, PressInputs, keep_top


def grouped_queries(inputs: PressInputs, press: str) -> torch.Tensor:
    """The window's queries as [kv_heads, group, W, head_dim]: query head j belongs to KV head
    j // group (GQA), group = heads // kv_heads. Raises ValueError (naming `press`) when the queries
    are missing or do not fit the region."""
    q = inputs.queries
    if q is None:
        raise ValueError(f"kv_press {press!r} needs the observation window's queries, got None")
    w, heads, dim = q.shape
    kv_heads = inputs.num_kv_heads
    if w == 0 or w > inputs.num_tokens:
        raise ValueError(f"kv_press {press!r}: the observation window ({w} queries) must be 1 .. "
                         f"{inputs.num_tokens} tokens, the region's last tokens")
    if heads % kv_heads or dim != inputs.keys.shape[-1]:
        raise ValueError(f"kv_press {press!r}: queries {tuple(q.shape)} do not fit keys "
                         f"{tuple(inputs.keys.shape)} (heads must be a multiple of kv_heads)")
    return q.float().reshape(w, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)


def window_attention(inputs: PressInputs, press: str) -> torch.Tensor:
    """[kv_heads, group, W, T] float32: each window query's attention probabilities over the
    region's keys, causal (query i sits at region index T - W + i and sees keys 0 .. T - W + i), as
    the model computed them. Memory is O(W * heads * T), a few such tensors at once."""
    q = grouped_queries(inputs, press)
    w, t = q.shape[2], inputs.num_tokens
    # Scale the queries, not the [.., W, T] logits: one fewer tensor of the largest size.
    logits = torch.einsum("hgwd,thd->hgwt", q * inputs.scale, inputs.keys.float())
    token = torch.arange(t, device=logits.device)
    sits_at = torch.arange(t - w, t, device=logits.device)
    logits.masked_fill_(token[None, :] > sits_at[:, None], float("-inf"))     # [W, T] broadcast
    return torch.softmax(logits, dim=-1)


def keep_tail(scores: torch.Tensor, n: int, bound: float) -> torch.Tensor:
    """`scores` [kv_heads, T] (all <= bound) with the last n tokens raised above every other score,
    the later one higher: keep_top keeps them first, and the most recent when keep < n."""
    n = min(n, scores.shape[-1])
    if n == 0:
        return scores
    tail = bound + 1 + torch.arange(n, device=scores.device, dtype=scores.dtype)
    return torch.cat([scores[:, :scores.shape[-1] - n], tail.expand(scores.shape[0], n)], dim=-1)


@dataclass(frozen=True)
class SnapKVPress:
    name: ClassVar[str] = "snapkv"
    needs_queries: ClassVar[bool] = True

    kernel_size: int = 5    # odd width of the average pooling along tokens (1: no pooling)

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"{self.name}: kernel_size must be odd and >= 1, got {self.kernel_size}")

    def score(self, inputs: PressInputs) -> torch.Tensor:
        """Per KV head, the mean over the window's queries and the group's query heads of the
        causal attention probabilities on each token before the window, average-pooled along those
        tokens (zero-padded to the same length, every sum divided by `kernel_size`; as in kvpress the
        window's own columns stay out of the pooling, or their locality-inflated attention would
        spill onto the tokens just before it); the window's tokens score above all of them."""
        probs = window_attention(inputs, self.name)
        w, t = probs.shape[2], probs.shape[3]
        prefix = probs[..., :t - w].mean(dim=(1, 2))                               # [kv_heads, T - W]
        if t > w:
            prefix = F.avg_pool1d(prefix[:, None, :], self.kernel_size, stride=1,
                                  padding=self.kernel_size // 2)[:, 0]
        # Pooled or not, a mean of probabilities is <= 1: the bound keep_tail raises the window over.
        return keep_tail(torch.cat([prefix, probs.new_zeros(prefix.shape[0], w)], dim=-1), w, 1.0)

    def compress(self, inputs: PressInputs, keep: int) -> Compressed:
        return keep_top(inputs, self.score(inputs), keep)

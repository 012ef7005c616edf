"""--preemption-mode auto: swap a preempted request's KV to the host tier, or free it and recompute,
whichever costs less time.

Swapping moves the request's KV bytes out and back over the host link; recomputing runs its tokens
through prefill again. Both rates are measured, not assumed: the link's rate from the tier's own
copies (a probe at start, then every load that lands), the prefill rate from the engine's steps
that computed many tokens. The swap is charged in full although its copies overlap other requests'
steps, and the recompute is charged at the prefill rate of a full batch: both err towards
recompute, which needs no host memory.

A token's prefill cost grows with the context before it (its attention reads every earlier token).
With the model's `ComputeShape`, the rate is kept per zero-context token: a step's work is its
tokens plus its attention pairs over the crossover (the context at which a token's attention costs
as much as its weights), and a recompute is charged the pairs of its own context. Without it, a
32k-token prefix was charged at the rate of the 8k-token chunks that had been timed, about a third
too little on an R1-Distill-Qwen-7B shape, and a disk read faster than recomputing was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvserve.model.compute_shape import ComputeShape, attention_pairs

# Steps computing at least this many tokens are prefill-bound enough to time prefill by.
MIN_PREFILL_TOKENS = 128
# Weight of a new observation in the moving averages.
SMOOTHING = 0.2


@dataclass
class PreemptionCost:
    kv_bytes_per_token: int
    transfer_bytes_per_s: Optional[float] = None      # host <-> device
    prefill_tokens_per_s: Optional[float] = None        # zero-context tokens, with `shape`
    shape: Optional[ComputeShape] = None
    num_swap_choices: int = 0
    num_recompute_choices: int = 0

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.transfer_bytes_per_s = smooth(self.transfer_bytes_per_s, nbytes / seconds)

    def observe_step(self, num_tokens: int, seconds: float, attention_pairs: int = 0) -> None:
        """A step's tokens per second is a lower bound of the prefill rate (decodes, small chunks and
        a first step that compiles kernels all run slower than a full prefill chunk): a faster step
        is taken at once, a slower one only eases the estimate down. A plain average stayed at the
        rate of small steps, so a tier read slower than recomputing was still started
        (docs/kv_tiers.md#disk-and-remote-tiers). `attention_pairs`: the step's (query, key) pairs,
        each new token's context; with a shape they count as work beside the tokens."""
        if num_tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            rate = self._work(num_tokens, attention_pairs) / seconds
            current = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if current is None or rate > current else smooth(current, rate)

    def swap_seconds(self, num_tokens: int) -> Optional[float]:
        if not self.transfer_bytes_per_s:
            return None
        return 2 * num_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def recompute_seconds(self, num_tokens: int, context_tokens: int = 0) -> Optional[float]:
        """Computing `num_tokens` tokens after `context_tokens` cached ones."""
        if not self.prefill_tokens_per_s:
            return None
        return self._work(num_tokens, attention_pairs(context_tokens, num_tokens)) / self.prefill_tokens_per_s

    def _work(self, num_tokens: int, pairs: int) -> float:
        """Zero-context token equivalents: the tokens, plus their attention pairs at the crossover."""
        if self.shape is None:
            return float(num_tokens)
        return num_tokens + pairs / self.shape.crossover_tokens

    def prefers_swap(self, num_tokens: int) -> bool:
        """Swap when it is measured cheaper. Before prefill has been timed, swap if the link has
        been measured (a request is preempted only after prompts have run, so this is brief)."""
        swap, recompute = self.swap_seconds(num_tokens), self.recompute_seconds(num_tokens)
        choice = swap is not None and (recompute is None or swap < recompute)
        if choice:
            self.num_swap_choices += 1
        else:
            self.num_recompute_choices += 1
        return choice


def smooth(current: Optional[float], value: float) -> float:
    """A moving average of measured rates (the first value as it is)."""
    return value if current is None else (1 - SMOOTHING) * current + SMOOTHING * value

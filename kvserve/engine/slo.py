"""Latency targets the scheduler keeps: time to first token (TTFT) and time per output token (TPOT).

Under overload a FIFO queue makes every request late: the queue grows, each newcomer waits longer
than the last, and a large batch slows every step. Goodput (requests that meet both targets per
second) then collapses, although the engine is busy. Two controls keep it up:

- TPOT: each running request gets one token per step, so the step time is its inter-token time.
  An additive-increase / multiplicative-decrease limit on the number of running requests keeps a
  smoothed step time under the target (less a margin for the host's own per-token work). It only
  gates admissions; running requests are never preempted for it, so after a cut the next waits
  until the batch has shrunk under the limit (as TCP cuts once per round trip). It is measured, not modelled, so
  it follows whatever the step costs on this machine (prompt chunks included).
- TTFT (with `slo_shed`): a request that can no longer start in time is rejected rather than
  served late. At arrival, when it would have to wait for a running slot, the wait is predicted
  from how many running requests must finish first and the recent completion rate; a waiting request whose
  deadline arrives before it was scheduled is rejected in the queue. Either way the client gets a
  clear "overloaded" error (HTTP 503) at once instead of an answer it has stopped waiting for, and
  the capacity goes to requests that can still be served in time.

Without targets (the default) none of this runs and scheduling is plain continuous batching.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

# The step time is held under this fraction of the TPOT target: the host's per-token work
# (detokenizing, streaming) adds to the time a client sees between tokens.
TPOT_MARGIN = 0.85
# Requests are shed when their first token would come after this fraction of the TTFT target:
# the estimate is a smoothed step time, and the token still has to reach the client.
TTFT_MARGIN = 0.9
# The limit grows while the smoothed step time is under this fraction of the held target.
GROW_BELOW = 0.9
DECREASE_FACTOR = 0.9         # multiplicative decrease per step over the target
INCREASE_STEP = 0.25          # additive increase per step under it (one more request per 4 steps)
STEP_TIME_SMOOTHING = 0.2     # weight of the newest step in the exponential average
COMPLETION_WINDOW_S = 10.0    # completions counted for the service-rate estimate
MIN_COMPLETIONS_FOR_RATE = 4  # fewer than this: no prediction at arrival (only the in-queue deadline)


class RequestOverloaded(RuntimeError):
    """The engine cannot start this request within its TTFT target: rejected, retry later (HTTP 503)."""


@dataclass
class SLOTargets:
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    shed: bool = False            # reject requests that cannot start within ttft_s

    @property
    def enabled(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


class SLOController:
    """Step-time smoothing, the running-request limit and the service-rate estimate."""

    def __init__(self, targets: SLOTargets, max_num_seqs: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.targets = targets
        self.max_num_seqs = max_num_seqs
        self.clock = clock
        self.step_time_s: Optional[float] = None          # exponential average over busy steps
        self._limit = float(max_num_seqs)
        self._completions: collections.deque[float] = collections.deque()
        self.num_rejected_at_arrival = 0
        self.num_rejected_in_queue = 0

    # --- observations --------------------------------------------------------------------------
    def observe_step(self, seconds: float, num_running: int) -> None:
        """One engine step that ran `num_running` requests took `seconds`."""
        if seconds <= 0 or num_running <= 0:
            return
        if self.step_time_s is None:
            self.step_time_s = seconds
        else:
            self.step_time_s += STEP_TIME_SMOOTHING * (seconds - self.step_time_s)
        target = self.step_time_target_s
        if target is None:
            return
        if self.step_time_s > target:
            # Cut from what runs now (a limit far above it would take many steps to bite), and only
            # once the last cut has taken effect: running requests are not preempted, so the batch
            # shrinks as they finish, and cutting on every slow step meanwhile would overshoot.
            if num_running <= self._limit:
                self._limit = max(1.0, num_running * DECREASE_FACTOR)
        elif self.step_time_s < GROW_BELOW * target and num_running >= int(self._limit):
            # Growing while the limit binds, whether or not anyone waits: with shedding, the demand
            # the limit holds back is rejected at arrival and never shows up as a queue.
            self._limit = min(float(self.max_num_seqs), self._limit + INCREASE_STEP)

    def observe_completion(self) -> None:
        now = self.clock()
        self._completions.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._completions and self._completions[0] < now - COMPLETION_WINDOW_S:
            self._completions.popleft()

    # --- decisions -----------------------------------------------------------------------------
    @property
    def step_time_target_s(self) -> Optional[float]:
        return None if self.targets.tpot_s is None else self.targets.tpot_s * TPOT_MARGIN

    @property
    def max_running(self) -> int:
        """How many requests may run at once under the TPOT target."""
        return max(1, min(self.max_num_seqs, int(self._limit)))

    def completion_rate(self) -> Optional[float]:
        """Completed requests per second over the recent window; None until enough were seen."""
        now = self.clock()
        self._trim(now)
        if len(self._completions) < MIN_COMPLETIONS_FOR_RATE:
            return None
        span = max(now - self._completions[0], 1e-3)
        return len(self._completions) / span

    def time_to_first_token_s(self, num_prompt_tokens: int, token_budget: int) -> float:
        """Once scheduled, a prompt needs this long to its first token: one step per budget's worth."""
        steps = max(1, math.ceil(num_prompt_tokens / max(1, token_budget)))
        return steps * (self.step_time_s or 0.0)

    def reject_at_arrival(self, num_ahead: int, num_prompt_tokens: int, token_budget: int) -> Optional[str]:
        """Why a request cannot start in time, or None, when it gets a running slot only after
        `num_ahead` + 1 running requests have finished."""
        if not self.targets.shed or self.targets.ttft_s is None:
            return None
        rate = self.completion_rate()
        if rate is None:
            return None
        wait = (num_ahead + 1) / rate
        expected = wait + self.time_to_first_token_s(num_prompt_tokens, token_budget)
        if expected <= self.targets.ttft_s * TTFT_MARGIN:
            return None
        self.num_rejected_at_arrival += 1
        return (f"server overloaded: {num_ahead + 1} running requests must finish before this one starts, at "
                f"{rate:.2f} completions/s, so the first token would come after ~{expected:.1f} s, over the "
                f"{self.targets.ttft_s:g} s TTFT target; retry later")

    def missed_deadline(self, arrival_time: float, num_prompt_tokens: int, token_budget: int,
                        now: float) -> bool:
        """A waiting request that, scheduled now, would still produce its first token too late."""
        if not self.targets.shed or self.targets.ttft_s is None:
            return False
        expected = now - arrival_time + self.time_to_first_token_s(num_prompt_tokens, token_budget)
        return expected > self.targets.ttft_s * TTFT_MARGIN

"""Latency targets the scheduler keeps: time to first token (TTFT) and time per output token (TPOT).

Under overload a FIFO queue makes every request late: the queue grows, each newcomer waits longer
than the last, and a large batch slows every step. Goodput (requests that meet both targets per
second) then collapses, although the engine is busy. Three controls keep it up:

- Step length: a step's tokens are capped so that the step, as the step-cost model
  (kvserve/sched/step_cost.py) predicts it, ends within a quarter of the TTFT target. A newcomer
  then never waits long for the step in progress before its own prompt can start.
- TPOT: each running request gets one token per step, so the step time is its inter-token time.
  An additive-increase / multiplicative-decrease limit on the number of running requests keeps a
  smoothed step time under the target (less a margin for the host's own per-token work). It only
  gates admissions; running requests are never preempted for it, so after a cut the next waits
  until the batch has shrunk under the limit (as TCP cuts once per round trip). It is measured, not
  modelled, so it follows whatever the step costs on this machine (prompt chunks included).
- TTFT (with `slo_shed`): a request that cannot get its first token in time is rejected rather
  than served late. At arrival, the steps ahead of it are simulated (`first_token_delay_s`): the
  requests running and queued (and those accepted by the server but not yet in the engine), with
  their prompt tokens left, the step budget, the running limit, and the step-cost model, which a
  start-up calibration primes, so the prediction holds from the first request on. A waiting request
  whose first token could no longer come in time, even if it were scheduled next, is rejected in
  the queue. Either way the client gets a clear "overloaded" error (HTTP 503) at once instead of an
  answer it has stopped waiting for, and the capacity goes to requests that can still be served in
  time.

Without targets (the default) none of this runs and scheduling is plain continuous batching.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from kvserve.sched.step_cost import StepCostModel, StepShape
from kvserve.stats import LatencyTargetStats, StepCoefficients

# The step time is held under this fraction of the TPOT target: the host's per-token work
# (detokenizing, streaming) adds to the time a client sees between tokens.
TPOT_MARGIN = 0.85
# Requests are shed when their first token would come after this fraction of the TTFT target:
# the estimate is a model, and the token still has to reach the client.
TTFT_MARGIN = 0.9
# A step may last at most this fraction of the TTFT target: a request arriving just after a step
# began waits for all of it before its own prompt can start.
STEP_SHARE_OF_TTFT = 0.25
# However tight the targets, a step computes its decodes and at least this many prompt tokens, so
# prompts always progress.
MIN_PROMPT_TOKENS_PER_STEP = 16
# The limit grows while the smoothed step time is under this fraction of the held target.
GROW_BELOW = 0.9
DECREASE_FACTOR = 0.9         # multiplicative decrease per step over the target
INCREASE_STEP = 0.25          # additive increase per step under it (one more request per 4 steps)
STEP_TIME_SMOOTHING = 0.2     # weight of the newest step in the exponential average
# Steps observed after a cut before the next one: the average lags the batch it measures, and a
# batch can shrink to a new limit at once (requests without a TPOT promise are preempted for a
# class's target), so cutting on each step of the lag would overshoot.
CUT_SETTLE_STEPS = 3
COMPLETION_WINDOW_S = 10.0    # completions counted for the completion-rate estimate
MIN_COMPLETIONS_FOR_RATE = 4  # fewer than this: running requests are taken to run to max_tokens
# A simulation of the steps ahead gives up past this many (the answer is then "too late").
MAX_SIMULATED_STEPS = 100_000


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


@dataclass(frozen=True)
class PendingWork:
    """One request (one sample) the engine has yet to finish, as the simulation needs it."""
    prompt_tokens_left: int      # tokens to compute before its next token; 0 while it decodes
    output_tokens_left: int      # tokens it may still generate (max_tokens less those out)


@dataclass(frozen=True)
class EngineLoad:
    """What the steps ahead depend on, copied on the engine thread so that the server's threads can
    predict without touching the scheduler."""
    running: tuple[PendingWork, ...] = ()     # in running order
    waiting: tuple[PendingWork, ...] = ()     # in queue order
    token_budget: int = 1                     # max_num_batched_tokens
    max_running: int = 1                      # the running limit (TPOT) or max_num_seqs
    max_step_s: Optional[float] = None        # the step-length cap (see step_token_budget)
    step_cost: Optional[StepCoefficients] = None
    # Completions per second recently (None until enough were seen): how fast running requests
    # free their slots, which their max_tokens bounds only loosely.
    completion_rate: Optional[float] = None
    # Of the running requests, how many rank below the new ones (priority policy): a new request
    # that finds no slot preempts one of them rather than waiting for a slot to free.
    preemptible: int = 0


def step_token_budget(token_budget: int, max_step_s: Optional[float], step_cost: Optional[StepCoefficients],
                      num_sequences: int) -> int:
    """The tokens a step of `num_sequences` requests may hold: the configured budget, cut so that the
    step ends within max_step_s, but never below its decodes plus a little prompt progress."""
    if max_step_s is None or step_cost is None:
        return token_budget
    room = max_step_s - step_cost.fixed_s - step_cost.per_sequence_s * num_sequences
    fitting = math.floor(room / step_cost.per_token_s) if step_cost.per_token_s > 0 else token_budget
    return max(1, min(token_budget, max(fitting, num_sequences + MIN_PROMPT_TOKENS_PER_STEP)))


def first_token_delay_s(load: EngineLoad, new: Iterable[PendingWork], horizon_s: float = math.inf) -> float:
    """Seconds until every request in `new`, queued behind `load`, has its first token, by stepping
    the scheduler's rules forward: running requests first, then admissions in queue order up to the
    running limit, decodes one token each, prompt chunks in order under the step's token budget, each
    step costing what the step-cost model says. The requests decoding now leave one per 1 /
    completion_rate seconds when that rate is known (the engine's own recent experience), else after
    their output tokens left (an upper bound: EOS often ends them sooner); requests that start during
    the simulation leave after theirs. Cache hits are counted as the load states them; KV capacity
    is not simulated. A queued request that finds no slot while `load.preemptible` running requests
    rank below the new ones takes the slot of one of them (the scheduler preempts it), the one
    due to leave last. Stops early once past `horizon_s`."""
    cost = load.step_cost
    targets = list(new)
    if cost is None or not targets:
        return 0.0
    queue: collections.deque[list] = collections.deque()    # [prompt tokens left, output tokens left, is new]
    prefilling: collections.deque[list] = collections.deque()
    leave_at_step: collections.Counter[int] = collections.Counter()   # step after which that many leave
    leave_at_time: collections.deque[float] = collections.deque()     # rate-based leaves, in seconds
    num_decoding = 0
    for work in load.running:
        if work.prompt_tokens_left > 0:
            prefilling.append([work.prompt_tokens_left, work.output_tokens_left, False])
        elif work.output_tokens_left > 0:
            num_decoding += 1
            if load.completion_rate is None:
                leave_at_step[work.output_tokens_left] += 1
    if load.completion_rate is not None:
        leave_at_time.extend((k + 1) / load.completion_rate for k in range(num_decoding))
    for work in load.waiting:
        queue.append([max(1, work.prompt_tokens_left), work.output_tokens_left, False])
    for work in targets:
        queue.append([max(1, work.prompt_tokens_left), work.output_tokens_left, True])
    targets_left, elapsed, step = len(targets), 0.0, 0
    preemptible = min(load.preemptible, num_decoding)

    def preempt_one() -> None:
        nonlocal num_decoding, preemptible
        num_decoding -= 1
        preemptible -= 1
        if leave_at_time:
            leave_at_time.pop()
        elif leave_at_step:
            last = max(leave_at_step)
            leave_at_step[last] -= 1
            if not leave_at_step[last]:
                del leave_at_step[last]

    for _ in range(MAX_SIMULATED_STEPS):
        if queue and preemptible > 0:
            while preemptible > 0 and num_decoding + len(prefilling) + 1 > load.max_running:
                preempt_one()
        if not prefilling and num_decoding >= load.max_running:
            # Only decodes until a running request leaves and frees a slot: skip to that moment.
            decode_step_s = cost.seconds(num_decoding, num_decoding)
            by_step = (elapsed + (min(leave_at_step) - step) * decode_step_s) if leave_at_step else math.inf
            by_time = leave_at_time[0] if leave_at_time else math.inf
            if by_step == by_time == math.inf:
                return math.inf
            if by_step <= by_time:
                step = min(leave_at_step)
                num_decoding -= leave_at_step.pop(step)
                elapsed = by_step
            else:
                step += max(1, math.ceil((by_time - elapsed) / decode_step_s)) if decode_step_s > 0 else 1
                leave_at_time.popleft()
                num_decoding -= 1
                elapsed = max(elapsed, by_time)
            if elapsed > horizon_s:
                return elapsed
            continue
        step += 1
        # As Scheduler.schedule: the cap from the requests running now (plus one admission), the
        # running requests' tokens first, then admissions in queue order while tokens and slots last.
        budget = step_token_budget(load.token_budget, load.max_step_s, cost, num_decoding + len(prefilling) + 1)
        room = max(0, budget - num_decoding)
        num_tokens, num_sequences = num_decoding, num_decoding
        for item in prefilling:
            if room <= 0:
                break
            take = min(item[0], room)
            item[0] -= take
            room -= take
            num_tokens += take
            num_sequences += 1
        while room > 0 and queue and num_decoding + len(prefilling) < load.max_running:
            item = queue.popleft()
            take = min(item[0], room)
            item[0] -= take
            room -= take
            num_tokens += take
            num_sequences += 1
            prefilling.append(item)
        elapsed += cost.seconds(num_tokens, num_sequences)
        # Chunks go in order, so the prompts finished this step lead the deque.
        while prefilling and prefilling[0][0] == 0:
            _, outputs_left, is_new = prefilling.popleft()
            if is_new:
                targets_left -= 1
                if not targets_left:
                    return elapsed
            if outputs_left > 1:
                num_decoding += 1
                leave_at_step[step + outputs_left - 1] += 1
        num_decoding -= leave_at_step.pop(step, 0)
        while leave_at_time and leave_at_time[0] <= elapsed:
            leave_at_time.popleft()
            num_decoding -= 1
        if elapsed > horizon_s:
            return elapsed
    return math.inf


class SLOController:
    """Step-time smoothing, the running-request limit, the step-cost model and the shedding rules."""

    def __init__(self, targets: SLOTargets, max_num_seqs: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.targets = targets
        self.max_num_seqs = max_num_seqs
        self.clock = clock
        self.step_time_s: Optional[float] = None          # exponential average over busy steps
        self.step_cost = StepCostModel()
        self._limit = float(max_num_seqs)
        self._steps_since_cut = CUT_SETTLE_STEPS
        # The tightest TPOT p99 target among the request classes with work now (the scheduler sets
        # it each step; kvserve/sched/qos_classes.py): one batch decodes every class, so its step
        # time is every class's time per token, and the strictest class with work sets it.
        self.class_tpot_s: Optional[float] = None
        self._completions: collections.deque[float] = collections.deque()
        self.num_rejected_at_arrival = 0
        self.num_rejected_in_queue = 0

    # --- observations --------------------------------------------------------------------------
    def observe_step(self, seconds: float, num_running: int, num_tokens: int = 0) -> None:
        """One engine step that ran `num_running` requests and `num_tokens` tokens took `seconds`."""
        if seconds <= 0 or num_running <= 0:
            return
        if num_tokens > 0:
            self.step_cost.observe(StepShape(num_tokens, num_running), seconds)
        if self.step_time_s is None:
            self.step_time_s = seconds
        else:
            self.step_time_s += STEP_TIME_SMOOTHING * (seconds - self.step_time_s)
        target = self.step_time_target_s
        if target is None:
            return
        self._steps_since_cut += 1
        if self.step_time_s > target:
            # Cut from what runs now (a limit far above it would take many steps to bite), and only
            # once the last cut has taken effect: the batch has shrunk under it (running requests
            # are not preempted for the server's target, so it shrinks as they finish) and the
            # average has seen a few steps of it. Cutting on every slow step meanwhile would overshoot.
            if num_running <= self._limit and self._steps_since_cut >= CUT_SETTLE_STEPS:
                self._limit = max(1.0, num_running * DECREASE_FACTOR)
                self._steps_since_cut = 0
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

    def completion_rate(self) -> Optional[float]:
        """Completed requests per second over the recent window; None until enough were seen."""
        now = self.clock()
        self._trim(now)
        if len(self._completions) < MIN_COMPLETIONS_FOR_RATE:
            return None
        return len(self._completions) / max(now - self._completions[0], 1e-3)

    # --- decisions -----------------------------------------------------------------------------
    @property
    def step_time_target_s(self) -> Optional[float]:
        held = [t for t in (self.targets.tpot_s, self.class_tpot_s) if t is not None]
        return min(held) * TPOT_MARGIN if held else None

    @property
    def max_step_s(self) -> Optional[float]:
        """How long one step may take under the TTFT target (None: no cap). The TPOT target caps
        no step: its running limit already holds the smoothed step time, prompt chunks included, and
        capping chunks to it as well cut prefill throughput (and goodput) under overload."""
        return None if self.targets.ttft_s is None else self.targets.ttft_s * STEP_SHARE_OF_TTFT

    @property
    def max_running(self) -> int:
        """How many requests may run at once under the TPOT target (none held: max_num_seqs; the
        limit is kept for when a target is held again)."""
        if self.step_time_target_s is None:
            return self.max_num_seqs
        return max(1, min(self.max_num_seqs, int(self._limit)))

    def expected_max_running(self) -> int:
        """The running limit the simulation of the steps ahead assumes: today's, or, under a TPOT
        target, no more decodes than the step-cost model fits in a step of the held time, which is
        where the limit goes once the steps ahead have been measured (a burst admitted by today's
        limit would otherwise be cut mid-way and wait in the queue past its deadline)."""
        limit = self.max_running
        cost, target = self.step_cost.coefficients, self.step_time_target_s
        if cost is None or target is None:
            return limit
        per_decode = cost.per_token_s + cost.per_sequence_s
        if per_decode <= 0:
            return limit
        return max(1, min(limit, math.floor((target - cost.fixed_s) / per_decode)))

    def step_token_budget(self, token_budget: int, num_sequences: int) -> int:
        return step_token_budget(token_budget, self.max_step_s, self.step_cost.coefficients, num_sequences)

    def shed_deadline_s(self) -> Optional[float]:
        """Seconds after arrival by which a first token must be predicted, when shedding."""
        if not self.targets.shed or self.targets.ttft_s is None:
            return None
        return self.targets.ttft_s * TTFT_MARGIN

    def reject_at_arrival(self, load: EngineLoad, new: list[PendingWork], waited_s: float) -> Optional[str]:
        """Why requests arriving behind `load`, after waiting `waited_s` already (tokenization, the
        server's queue), cannot get their first token in time, or None."""
        deadline = self.shed_deadline_s()
        if deadline is None:
            return None
        delay = first_token_delay_s(load, new, horizon_s=deadline - waited_s)
        if waited_s + delay <= deadline:
            return None
        ahead = sum(w.prompt_tokens_left for w in load.running + load.waiting)
        return (f"server overloaded: the first token would come after ~{waited_s + delay:.1f} s "
                f"({ahead} prompt tokens queued ahead, {len(load.running)} requests running), over the "
                f"{self.targets.ttft_s:g} s TTFT target; retry later")

    def make_stats(self, step_token_budget: int) -> LatencyTargetStats:
        return LatencyTargetStats(self.max_running, self.step_time_s, self.num_rejected_at_arrival,
                                  self.num_rejected_in_queue, self.step_cost.coefficients, step_token_budget,
                                  ttft_target_s=self.targets.ttft_s, tpot_target_s=self.targets.tpot_s)

    def prefill_seconds(self, num_prompt_tokens: int, num_decoding: int, token_budget: int) -> float:
        """The least time a prompt needs once scheduled: its chunks beside the running decodes."""
        cost = self.step_cost.coefficients
        if cost is None:
            return 0.0
        budget = self.step_token_budget(token_budget, num_decoding + 1)
        per_step = max(1, budget - num_decoding)
        steps = max(1, math.ceil(num_prompt_tokens / per_step))
        last = num_prompt_tokens - (steps - 1) * per_step
        return ((steps - 1) * cost.seconds(num_decoding + per_step, num_decoding + 1)
                + cost.seconds(num_decoding + last, num_decoding + 1))

    def missed_deadline(self, arrival_time: float, num_prompt_tokens: int, num_decoding: int, token_budget: int,
                        now: float, deadline: Optional[float] = None) -> bool:
        """A waiting request that, scheduled now, would still produce its first token too late
        (after `deadline` seconds from arrival: by default the server's)."""
        if deadline is None:
            deadline = self.shed_deadline_s()
        if deadline is None:
            return False
        return now - arrival_time + self.prefill_seconds(num_prompt_tokens, num_decoding, token_budget) > deadline

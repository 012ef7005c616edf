"""Stats as data: what the engine's parts report about themselves, as frozen dataclasses.

Each owner builds its own (`KVCacheManager.make_stats`, `SLOController.make_stats`,
`Scheduler.make_stats`, `Engine.make_stats`) on the engine thread; readers on other threads (the
server's metrics, a dashboard, a trace) read only these, never the owners. A leaf module, so that
every layer can return them; adding a metric is adding a field here and a line in its owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class StepCoefficients:
    fixed_s: float
    per_token_s: float
    per_sequence_s: float

    def seconds(self, num_tokens: int, num_sequences: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens + self.per_sequence_s * num_sequences


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    usage: float                 # fraction of blocks in use (held by requests or cached)
    capacity_tokens: int         # num_blocks x block_size: what the cache holds in tokens


@dataclass(frozen=True)
class LatencyTargetStats:
    """The latency controls (--slo-ttft / --slo-tpot; sched/slo.py)."""
    max_running: int                                  # the running limit the TPOT target sets
    step_time_s: Optional[float]                      # the smoothed step time it is held by
    rejected_at_arrival: int                          # shed on arrival by the engine (the server adds its own)
    rejected_in_queue: int                            # shed at their deadline in the queue
    step_cost: Optional[StepCoefficients]             # the step-cost model (None before any data)
    step_token_budget: int                            # tokens the next step may hold


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    latency: Optional[LatencyTargetStats] = None      # None without latency targets


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats
    kv_cache: KVCacheStats
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: dict[str, int] = field(default_factory=dict)   # by finish reason

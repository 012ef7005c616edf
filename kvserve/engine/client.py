"""What the HTTP server needs from an engine, whichever process the engine runs in: the
`EngineClient` protocol, the facts of the served model, the stream a request's outputs arrive on,
the snapshot of engine gauges the metrics read, and the errors a request can end with.

Two engine clients implement it: `AsyncEngine` (kvserve/engine/async_engine.py: the engine on a
thread of this process, for embedding and tests) and `CoreClient` (kvserve/engine/core_client.py:
the engine core in a process of its own, what `kvserve serve` runs).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from kvserve.engine.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.stats import (BandwidthStats, ClassLatencyStats, ColdStoreStats, ConfigEvent, EngineStats,
                           ExpertLoadStats, HostTierStats, PrefixCacheStats, PressStats, RuntimeConfigStats,
                           StepCoefficients, TenantShareStats, TenantUsage, TransferStats)


class EngineShutdownError(RuntimeError):
    """The engine stopped (or is stopping) before this request could finish."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was in the engine; the request was aborted."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges and totals, copied on the engine thread after each loop iteration."""
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_usage: float = 0.0
    capacity_tokens: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    decode_kv_bytes_total: int = 0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    num_step_errors_total: int = 0
    requests_finished_total: dict[str, int] = field(default_factory=dict)
    # Latency targets (None without --slo-ttft / --slo-tpot): the running limit they set, the smoothed
    # step time it is held by, and requests shed at arrival / in the queue.
    slo_max_running: Optional[int] = None
    slo_step_time_s: Optional[float] = None
    slo_rejected_at_arrival: int = 0
    slo_rejected_in_queue: int = 0
    # The step-cost model's coefficients (seconds: fixed, per token, per sequence) and the token cap
    # of the next step they give: what the shedding predictions and the step length rest on.
    slo_step_cost: Optional[StepCoefficients] = None
    slo_step_token_budget: Optional[int] = None
    # The targets themselves, as the scheduler holds them now (the admin config API may change them):
    # what /metrics judges finished requests by.
    slo_ttft_target_s: Optional[float] = None
    slo_tpot_target_s: Optional[float] = None
    # The prefix cache's and the MoE expert load's stats as the engine made them (None: not there).
    prefix_cache: Optional[PrefixCacheStats] = None
    expert_load: Optional[ExpertLoadStats] = None
    kv_host: Optional[HostTierStats] = None          # the host KV tier (None: off)
    kv_transfers: Optional[TransferStats] = None     # its copies (None: no host tier)
    kv_cold: tuple[ColdStoreStats, ...] = ()          # the disk / remote KV tiers (none: off)
    kv_cold_hit_tokens: dict[str, int] = field(default_factory=dict)   # tier -> prompt tokens it supplied
    kv_cold_writes_dropped: int = 0                   # blocks not sent down: the write queue was full
    kv_cold_prefetches: dict[str, int] = field(default_factory=dict)   # outcome -> prefetches on arrival
    presses: tuple[PressStats, ...] = ()              # KV presses that have run (docs/kv_compression.md)
    kv_blocks_by_tenant: dict[Optional[str], int] = field(default_factory=dict)   # running + loading requests'
    qos_classes: tuple[ClassLatencyStats, ...] = ()   # request classes (--qos-config; docs/qos.md)
    kv_quotas: dict[str, tuple[int, int]] = field(default_factory=dict)   # tenant -> (resident blocks, quota)
    # Per tenant: requests that left the engine and their tokens; the fair policy's counters (None:
    # another policy). /metrics and the operator's /v1/usage read these.
    tenant_usage: dict[Optional[str], TenantUsage] = field(default_factory=dict)
    fair_share: Optional[dict[Optional[str], TenantShareStats]] = None
    bandwidth: Optional[BandwidthStats] = None        # memory bandwidth per step (None: no step measured yet)
    config_events: tuple[ConfigEvent, ...] = ()       # run-time config changes, oldest first (bounded)
    runtime_config: Optional[RuntimeConfigStats] = None   # the reconfigurable settings now, changes per field

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @classmethod
    def from_stats(cls, stats: EngineStats, num_steps: int, num_step_errors: int,
                   rejected_by_gate: int) -> "EngineSnapshot":
        """The snapshot of an engine's stats, with this thread's own counters (steps, step errors,
        requests the arrival gate shed) added."""
        sched, kv = stats.scheduler, stats.kv_cache
        latency = {}
        if sched.latency is not None:
            lt = sched.latency
            latency = dict(slo_max_running=lt.max_running, slo_step_time_s=lt.step_time_s,
                           slo_rejected_at_arrival=lt.rejected_at_arrival + rejected_by_gate,
                           slo_rejected_in_queue=lt.rejected_in_queue, slo_step_cost=lt.step_cost,
                           slo_step_token_budget=lt.step_token_budget, slo_ttft_target_s=lt.ttft_target_s,
                           slo_tpot_target_s=lt.tpot_target_s)
        # Loading requests (KV on its way from a tier) wait to run too.
        return cls(num_running=sched.num_running, num_waiting=sched.num_waiting + sched.num_loading,
                   num_blocks=kv.num_blocks,
                   num_free_blocks=kv.num_free_blocks, kv_usage=kv.usage, capacity_tokens=kv.capacity_tokens,
                   prompt_tokens_total=stats.prompt_tokens_total, generation_tokens_total=stats.generation_tokens_total,
                   num_preemptions_total=sched.num_preemptions_total, num_steps_total=num_steps,
                   num_step_errors_total=num_step_errors, requests_finished_total=dict(stats.requests_finished_total),
                   prefix_cache=stats.prefix_cache, expert_load=stats.expert_load, kv_host=kv.host,
                   kv_transfers=kv.transfers, kv_cold=kv.cold, kv_cold_hit_tokens=dict(kv.cold_hit_tokens),
                   kv_cold_writes_dropped=kv.cold_writes_dropped, kv_cold_prefetches=dict(kv.cold_prefetches),
                   presses=stats.presses, decode_kv_bytes_total=stats.decode_kv_bytes_total,
                   kv_blocks_by_tenant=dict(sched.kv_blocks_by_tenant), qos_classes=tuple(sched.classes),
                   kv_quotas=dict(sched.kv_quotas),
                   tenant_usage=dict(stats.tenant_usage), fair_share=stats.fair_share,
                   bandwidth=stats.bandwidth, config_events=stats.config_events,
                   runtime_config=stats.runtime_config, **latency)


@dataclass
class FinishedRequest:
    """What a metrics hook learns about a request when it leaves the engine."""
    request_id: str
    finish_reason: str                 # stop / length / abort / rejected / error
    arrival_time: float                # time.monotonic() when AsyncEngine.add_request was called
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int         # summed over the request's n samples
    max_sample_tokens: int             # tokens of its longest sample (for time per output token)
    tenant: Optional[str] = None
    priority: int = 0


class StreamTrace(Protocol):
    """What a stream's trace needs to hear (kvserve/obs/tracing.py): the stream is over, with
    these finished outputs (a request aborted before it finished is missing)."""

    def end(self, final_outputs: dict[str, RequestOutput]) -> None: ...


class RequestStream:
    """Async iterator over the outputs of one or more requests (e.g. a multi-prompt completion).

    Outputs are cumulative, so when the consumer falls behind only the newest output of each
    request is kept (`__anext__` drains what has arrived and coalesces by request id). Iteration
    ends once every request added to the stream has finished; an engine-side failure is raised
    from `__anext__`.
    """

    def __init__(self, engine: "EngineClient") -> None:
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ready: dict[str, RequestOutput] = {}
        self._pending: set[str] = set()
        self._finished: set[str] = set()
        # Each request's finished output, as it came: what a request trace is built from.
        self.final_outputs: dict[str, RequestOutput] = {}
        self.trace: Optional["StreamTrace"] = None      # the server's trace of this stream (None: not traced)

    @property
    def finished(self) -> bool:
        return not self._pending and not self._ready

    def _take(self, item: tuple[str, Any]) -> None:
        request_id, payload = item
        if isinstance(payload, BaseException):
            raise payload
        self._ready.pop(request_id, None)   # re-insert so the dict keeps arrival order
        self._ready[request_id] = payload

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._ready:
            if not self._pending:
                raise StopAsyncIteration
            self._take(await self._queue.get())
        while not self._queue.empty():
            self._take(self._queue.get_nowait())
        request_id = next(iter(self._ready))
        output = self._ready.pop(request_id)
        if output.finished:
            self._pending.discard(request_id)
            self._finished.add(request_id)
            self.final_outputs[request_id] = output
        return output

    def abort(self) -> None:
        """Aborts the stream's unfinished requests (their KV blocks are freed on the engine thread)."""
        for request_id in list(self._pending):
            self._engine.abort(request_id)
        self._pending.clear()
        self._ready.clear()


class EngineDeadError(RuntimeError):
    """The engine core process died (killed, out of memory, a kernel fault) with this request in it."""


@dataclass(frozen=True)
class ServedModel:
    """Facts of the served model and engine that never change once it is built: what the HTTP side
    checks requests against."""
    model: Optional[str]             # --model as given
    load_format: str
    source_path: str                 # the resolved folder or file
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    capacity_tokens: int             # KV cache size in tokens
    slo_ttft_s: Optional[float] = None
    slo_tpot_s: Optional[float] = None


class EngineClient(Protocol):
    """The engine as the server drives it. Every coroutine runs on the server's event loop; outputs
    arrive on the RequestStream `add_request` returns."""

    served: ServedModel
    tokenizer: Any                   # what prompts are encoded with on this side (None: ids only)
    on_request_finished: Optional[Callable[[FinishedRequest], None]]

    def start(self) -> None: ...

    async def shutdown(self, drain_timeout: float = 30.0) -> None: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def snapshot(self) -> EngineSnapshot: ...

    def open_stream(self) -> RequestStream: ...

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *,
                          stream: Optional[RequestStream] = None, tenant: Optional[str] = None,
                          priority: int = 0, arrival_time: Optional[float] = None,
                          trace: bool = False) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    async def pin_prefix(self, token_ids: list[int], ttl_s: float, tenant: Optional[str],
                         cache_salt: Optional[str], num_tokens: Optional[int]) -> dict[str, Any]: ...

    async def unpin_prefix(self, pin_id: int, tenant: Optional[str]) -> bool: ...

    async def list_pins(self, tenant: Optional[str]) -> list[dict[str, Any]]: ...

    async def kv_map(self, **bounds: int) -> dict[str, Any]:
        """Engine.make_kv_map(**bounds) as KVMapSnapshot.as_dict() (kvserve/stats.py): the KV cache
        block by block, made between steps (the dashboard's grid)."""
        ...

    async def runtime_config(self) -> dict[str, Any]:
        """Every setting the admin config API may change, as the engine uses it now
        (Engine.runtime_config; kvserve/engine/runtime_config.py)."""

    async def reconfigure(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Applies `changes` between steps, all or none: {"changed": {field: {"old", "new"}}, "config":
        every setting after}; ValueError naming the field for a change the engine refuses."""

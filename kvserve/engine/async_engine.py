"""AsyncEngine: the synchronous Engine driven from one background thread, for asyncio servers.

The Engine is not thread-safe, so exactly one thread (the engine thread) ever touches it. The
asyncio side talks to that thread through a command queue (add / abort / call / stop) that the
thread drains at the top of every loop iteration; results travel back through per-stream
asyncio queues, fed in one `loop.call_soon_threadsafe` per engine step. The event loop therefore
never waits on a model forward pass.

What the thread owns: the Engine, the table of live requests (`_records`), and the published
`EngineSnapshot` (an immutable copy of the gauges a metrics endpoint wants, replaced after every
iteration so readers on other threads never look at the engine itself).

Failure model: an exception in `step()` is delivered to every request that was in the engine
(each is aborted so its KV blocks come back) and the loop goes on with the next command.
`shutdown()` stops admissions, lets in-flight requests finish within a drain timeout, then
aborts the rest with `EngineShutdownError`; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvserve.engine.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.sched.slo import EngineLoad, PendingWork, RequestOverloaded, SLOController
from kvserve.stats import EngineStats, ExpertLoadStats, HostTierStats, PrefixCacheStats, StepCoefficients, TransferStats

logger = logging.getLogger("kvserve.async_engine")


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
    # The prefix cache's and the MoE expert load's stats as the engine made them (None: not there).
    prefix_cache: Optional[PrefixCacheStats] = None
    expert_load: Optional[ExpertLoadStats] = None
    kv_host: Optional[HostTierStats] = None          # the host KV tier (None: off)
    kv_transfers: Optional[TransferStats] = None     # its copies (None: no host tier)

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
                           slo_step_token_budget=lt.step_token_budget)
        # Loading requests (KV on its way from a tier) wait to run too.
        return cls(num_running=sched.num_running, num_waiting=sched.num_waiting + sched.num_loading,
                   num_blocks=kv.num_blocks,
                   num_free_blocks=kv.num_free_blocks, kv_usage=kv.usage, capacity_tokens=kv.capacity_tokens,
                   prompt_tokens_total=stats.prompt_tokens_total, generation_tokens_total=stats.generation_tokens_total,
                   num_preemptions_total=sched.num_preemptions_total, num_steps_total=num_steps,
                   num_step_errors_total=num_step_errors, requests_finished_total=dict(stats.requests_finished_total),
                   prefix_cache=stats.prefix_cache, expert_load=stats.expert_load, kv_host=kv.host,
                   kv_transfers=kv.transfers, **latency)


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


@dataclass
class _Record:
    """Engine-thread bookkeeping for one live request."""
    request_id: str
    stream: "RequestStream"
    arrival_time: float
    tenant: Optional[str]
    priority: int
    last_output: Optional[RequestOutput] = None


class RequestStream:
    """Async iterator over the outputs of one or more requests (e.g. a multi-prompt completion).

    Outputs are cumulative, so when the consumer falls behind only the newest output of each
    request is kept (`__anext__` drains what has arrived and coalesces by request id). Iteration
    ends once every request added to the stream has finished; an engine-side failure is raised
    from `__anext__`.
    """

    def __init__(self, engine: "AsyncEngine") -> None:
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ready: dict[str, RequestOutput] = {}
        self._pending: set[str] = set()
        self._finished: set[str] = set()

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
        return output

    def abort(self) -> None:
        """Aborts the stream's unfinished requests (their KV blocks are freed on the engine thread)."""
        for request_id in list(self._pending):
            self._engine.abort(request_id)
        self._pending.clear()
        self._ready.clear()


class ArrivalGate:
    """TTFT shedding at arrival, decided on the caller's thread: the engine thread takes new requests
    only between steps, and a step can take a good share of the target, so a request that cannot be
    served in time is told so at once instead of after the step in progress.

    It judges a request as the scheduler would (SLOController.reject_at_arrival): queued behind the
    engine's load as last published by the engine thread, plus the requests accepted here that the
    engine thread has not taken yet (a burst arrives faster than one step). The lock makes "taken by
    the engine" and "the load that includes it" change together."""

    def __init__(self, slo: SLOController) -> None:
        self.slo = slo
        self._lock = threading.Lock()
        self._load = EngineLoad()
        self._pending: dict[str, list[PendingWork]] = {}
        self.num_rejected = 0

    def admit(self, request_id: str, work: list[PendingWork], waited_s: float) -> None:
        """Raises RequestOverloaded, or records the request as on its way to the engine."""
        with self._lock:
            pending = tuple(w for works in self._pending.values() for w in works)
            load = dataclasses.replace(self._load, waiting=self._load.waiting + pending)
        reason = self.slo.reject_at_arrival(load, work, waited_s)
        with self._lock:
            if reason is not None:
                self.num_rejected += 1
                raise RequestOverloaded(reason)
            self._pending[request_id] = work

    def taken(self, request_ids: list[str], load: EngineLoad) -> None:
        """Engine thread, once per batch of commands: these requests are in the engine (or were
        refused there) and `load` includes them. Until then they count as pending, so none is ever
        missing from what arrivals are judged against."""
        with self._lock:
            for request_id in request_ids:
                self._pending.pop(request_id, None)
            self._load = load

    def publish(self, load: EngineLoad) -> None:
        with self._lock:
            self._load = load


class AsyncEngine:
    """Runs `engine.step()` on a background thread; add/abort from the asyncio loop."""

    def __init__(self, engine: Any, *,
                 on_request_finished: Optional[Callable[[FinishedRequest], None]] = None) -> None:
        self.engine = engine
        self.on_request_finished = on_request_finished
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._records: dict[str, _Record] = {}
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._accepting = False
        self._stop_requested = False
        self._num_steps = 0
        self._num_step_errors = 0
        self._snapshot = EngineSnapshot()
        self._fatal_error: Optional[BaseException] = None
        slo = engine.scheduler.slo
        self.arrival_gate: Optional[ArrivalGate] = (ArrivalGate(slo) if slo is not None
                                                    and slo.shed_deadline_s() is not None else None)

    # --- lifecycle (event loop side) --------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread; call from the running event loop that will consume outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._accepting

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot


    async def shutdown(self, drain_timeout: float = 30.0, join_timeout: float = 10.0) -> None:
        """Refuses new requests, waits up to `drain_timeout` s for in-flight ones, then aborts the
        rest (their streams raise EngineShutdownError) and stops the thread."""
        self._accepting = False
        if self._thread is None:
            return
        deadline = time.monotonic() + max(0.0, drain_timeout)
        while self._records and self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._submit(("stop",))
        await asyncio.to_thread(self._thread.join, join_timeout)
        if self._thread.is_alive():
            logger.error("engine thread did not stop within %.1f s (a step is still running)", join_timeout)

    # --- requests (event loop side) -----------------------------------------------------------------
    def open_stream(self) -> RequestStream:
        return RequestStream(self)

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *,
                          stream: Optional[RequestStream] = None, tenant: Optional[str] = None,
                          priority: int = 0, arrival_time: Optional[float] = None) -> RequestStream:
        """Queues a request on the engine thread; raises what `Engine.add_request` raises
        (RequestRejected / ValueError / RequestOverloaded) or EngineShutdownError. `arrival_time`
        (time.monotonic()) is when the server received it; default now. Returns the stream its
        outputs go to."""
        if not self._accepting or self._thread is None or not self._thread.is_alive():
            raise EngineShutdownError("the engine is not accepting requests (shutting down or stopped)")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if self.arrival_gate is not None:
            work = self._pending_work(prompt, params)
            if work is not None:
                self.arrival_gate.admit(request_id, work, time.monotonic() - arrival_time)
        stream = stream or self.open_stream()
        record = _Record(request_id, stream, arrival_time, tenant, priority)
        done: concurrent.futures.Future = concurrent.futures.Future()
        stream._pending.add(request_id)
        self._submit(("add", record, prompt, params, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The caller went away while the add was queued: make sure it does not run unattended.
            self.abort(request_id)
            stream._pending.discard(request_id)
            raise
        except BaseException:
            stream._pending.discard(request_id)
            raise
        return stream

    def _pending_work(self, prompt: Any, params: SamplingParams) -> Optional[list[PendingWork]]:
        """The request as the arrival gate simulates it; None for a prompt not yet tokenized (the
        engine thread then judges it alone)."""
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            return None
        ids = prompt["prompt_token_ids"]
        max_tokens = params.max_tokens if params.max_tokens is not None else self.engine.max_model_len - len(ids)
        # Safe from this thread (it only reads the prefix cache); a burst's shared system prompt is
        # computed once, so counting it in every request would shed many that would make it.
        cached = self.engine.estimate_cached_prompt_tokens(ids, prompt.get("tenant"), prompt.get("cache_salt"))
        return [PendingWork(max(1, len(ids) - cached), max(1, max_tokens))] * params.n

    def abort(self, request_id: str) -> None:
        """Thread-safe and non-blocking; the engine frees the request's blocks before its next step."""
        self._submit(("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps (for inspection in tests and tools)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, done))
        return await asyncio.wrap_future(done)

    def _submit(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    # Idle: sleep until a command arrives rather than spinning on an empty engine.
                    while not self._commands and not engine.has_unfinished_requests():
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                for command in commands:
                    self._apply(command)
                if self.arrival_gate is not None:
                    added = [command[1].request_id for command in commands if command[0] == "add"]
                    if added:
                        self.arrival_gate.taken(added, engine.scheduler.make_load())
                if self._stop_requested:
                    break
                if engine.has_unfinished_requests():
                    self._step()
                self._publish_snapshot()
        except BaseException as exc:  # a bug in this loop itself: fail everything, never hang callers
            logger.exception("engine thread crashed")
            self._fatal_error = exc
        finally:
            self._accepting = False
            self._stop_all(EngineShutdownError("the engine stopped before this request finished"
                                               if self._fatal_error is None else
                                               f"the engine stopped after an internal error "
                                               f"({type(self._fatal_error).__name__})"))
            self._publish_snapshot()

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, record, prompt, params, done = command
            if self._stop_requested:
                done.set_exception(EngineShutdownError("the engine is shutting down"))
                return
            try:
                self.engine.add_request(record.request_id, prompt, params, arrival_time=record.arrival_time)
            except Exception as exc:
                done.set_exception(exc)
                return
            self._records[record.request_id] = record
            done.set_result(record.request_id)
        elif kind == "abort":
            record = self._records.pop(command[1], None)
            if record is not None:
                self._safe_abort(record.request_id)
                self._report_finished(record, "abort")
        elif kind == "call":
            _, fn, done = command
            try:
                done.set_result(fn(self.engine))
            except Exception as exc:
                done.set_exception(exc)
        elif kind == "stop":
            self._stop_requested = True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._num_step_errors += 1
            logger.exception("engine step failed; aborting the %d requests in the engine", len(self._records))
            error = EngineStepError(f"the engine failed while running this request ({type(exc).__name__})")
            self._fail_records(error, "error")
            if self.engine.has_unfinished_requests():
                # Requests nobody here owns survived the abort: back off instead of failing hot.
                with self._cond:
                    self._cond.wait(timeout=0.05)
            return
        self._num_steps += 1
        deliveries = []
        for output in outputs:
            record = self._records.get(output.request_id)
            if record is None:
                continue   # aborted from the loop side after this step started
            record.last_output = output
            deliveries.append((record.stream, output.request_id, output))
            if output.finished:
                del self._records[output.request_id]
                reason = output.outputs[0].finish_reason if output.outputs else None
                self._report_finished(record, reason or "stop")
        self._deliver(deliveries)

    def _fail_records(self, error: BaseException, reason: str) -> None:
        records = list(self._records.values())
        self._records.clear()
        for record in records:
            self._safe_abort(record.request_id)
            self._report_finished(record, reason)
        self._deliver([(record.stream, record.request_id, error) for record in records])

    def _stop_all(self, error: BaseException) -> None:
        # Commands that arrived after the stop must not leave a caller waiting on its future.
        with self._cond:
            commands, self._commands = self._commands, []
        for command in commands:
            if command[0] == "add":
                command[-1].set_exception(error)
            elif command[0] == "call":
                command[-1].set_exception(error)
        self._fail_records(error, "abort")

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("engine.abort(%s) failed", request_id)

    def _deliver(self, deliveries: list[tuple[RequestStream, str, Any]]) -> None:
        if not deliveries or self._loop is None:
            return

        def put_all() -> None:
            for stream, request_id, payload in deliveries:
                stream._queue.put_nowait((request_id, payload))
        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:
            pass   # the loop is closed: nobody is left to read these outputs

    def _report_finished(self, record: _Record, reason: str) -> None:
        if self.on_request_finished is None:
            return
        output = record.last_output
        metrics = output.metrics if output is not None else None
        samples = output.outputs if output is not None else []
        info = FinishedRequest(
            request_id=record.request_id, finish_reason=reason, arrival_time=record.arrival_time,
            first_scheduled_time=metrics.first_scheduled_time if metrics else None,
            first_token_time=metrics.first_token_time if metrics else None,
            finished_time=(metrics.finished_time if metrics and metrics.finished_time else time.monotonic()),
            num_prompt_tokens=len(output.prompt_token_ids) if output is not None else 0,
            num_generation_tokens=sum(len(s.token_ids) for s in samples),
            max_sample_tokens=max((len(s.token_ids) for s in samples), default=0),
            tenant=record.tenant, priority=record.priority)
        try:
            self.on_request_finished(info)
        except Exception:
            logger.exception("on_request_finished hook failed")

    def _publish_snapshot(self) -> None:
        engine = self.engine
        try:
            stats: EngineStats = engine.make_stats()
            self._snapshot = EngineSnapshot.from_stats(stats, self._num_steps, self._num_step_errors,
                                                       self.arrival_gate.num_rejected if self.arrival_gate else 0)
            if self.arrival_gate is not None:
                self.arrival_gate.publish(engine.scheduler.make_load())
        except Exception:
            logger.exception("could not read engine state for the metrics snapshot")

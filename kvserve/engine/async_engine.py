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
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvserve.engine.client import (EngineShutdownError, EngineSnapshot, EngineStepError, FinishedRequest,
                                   RequestStream, ServedModel)
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.runtime_config import reconfigure_reply
from kvserve.sampling_params import SamplingParams
from kvserve.sched.slo import EngineLoad, PendingWork, RequestOverloaded, SLOController
from kvserve.stats import EngineStats

__all__ = ["AsyncEngine", "ArrivalGate", "EngineShutdownError", "EngineSnapshot", "EngineStepError",
           "FinishedRequest", "RequestStream", "served_model_of"]

logger = logging.getLogger("kvserve.async_engine")


@dataclass
class _Record:
    """Engine-thread bookkeeping for one live request."""
    request_id: str
    stream: "RequestStream"
    arrival_time: float
    tenant: Optional[str]
    priority: int
    last_output: Optional[RequestOutput] = None
    trace: bool = False                 # record its phases (the server's tracer)


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


def served_model_of(engine: Any) -> ServedModel:
    """The facts of an Engine the HTTP side checks requests against."""
    model_config, scheduler_config = engine.config.model_config, engine.config.scheduler_config
    return ServedModel(model=model_config.model, load_format=model_config.load_format,
                       source_path=str(engine.source.path), max_model_len=int(engine.max_model_len),
                       vocab_size=int(engine.model.config.vocab_size),
                       max_num_seqs=int(scheduler_config.max_num_seqs),
                       capacity_tokens=int(engine.kv_manager.capacity_tokens),
                       slo_ttft_s=scheduler_config.slo_ttft, slo_tpot_s=scheduler_config.slo_tpot)


class AsyncEngine:
    """Runs `engine.step()` on a background thread; add/abort from the asyncio loop (an
    EngineClient, kvserve/engine/client.py)."""

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

    @functools.cached_property
    def served(self) -> ServedModel:
        return served_model_of(self.engine)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

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
                          priority: int = 0, arrival_time: Optional[float] = None,
                          trace: bool = False) -> RequestStream:
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
        record = _Record(request_id, stream, arrival_time, tenant, priority, trace=trace)
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

    async def pin_prefix(self, token_ids: list[int], ttl_s: float, tenant: Optional[str],
                         cache_salt: Optional[str], num_tokens: Optional[int]) -> dict[str, Any]:
        return await self.call(lambda engine: engine.pin_prefix({"prompt_token_ids": token_ids}, ttl_s, tenant=tenant,
                                                                cache_salt=cache_salt, num_tokens=num_tokens).as_dict())

    async def unpin_prefix(self, pin_id: int, tenant: Optional[str]) -> bool:
        return await self.call(lambda engine: engine.unpin_prefix(pin_id, tenant=tenant))

    async def list_pins(self, tenant: Optional[str]) -> list[dict[str, Any]]:
        return await self.call(lambda engine: [pin.as_dict() for pin in engine.prefix.pins(tenant)])

    async def kv_map(self, **bounds: int) -> dict[str, Any]:
        return await self.call(lambda engine: engine.make_kv_map(**bounds).as_dict())

    async def runtime_config(self) -> dict[str, Any]:
        return await self.call(lambda engine: engine.runtime_config())

    async def reconfigure(self, changes: dict[str, Any]) -> dict[str, Any]:
        def apply(engine: Any) -> dict[str, Any]:
            reply = reconfigure_reply(engine, changes)
            self._publish_snapshot()    # /metrics and the page see the change before the caller's answer
            return reply
        return await self.call(apply)

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
                        if engine.has_pending_tier_work:
                            break                 # flushed below, before sleeping
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
                elif engine.has_pending_tier_work:
                    engine.flush_tiers()          # the last steps' blocks, down to disk / Redis now
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
            engine.close()          # the cold KV tiers' last writes (a restarted server finds them)

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, record, prompt, params, done = command
            if self._stop_requested:
                done.set_exception(EngineShutdownError("the engine is shutting down"))
                return
            try:
                self.engine.add_request(record.request_id, prompt, params, arrival_time=record.arrival_time,
                                        priority=record.priority, trace=record.trace)
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
        any_finished = False
        for output in outputs:
            record = self._records.get(output.request_id)
            if record is None:
                continue   # aborted from the loop side after this step started
            record.last_output = output
            deliveries.append((record.stream, output.request_id, output))
            if output.finished:
                any_finished = True
                del self._records[output.request_id]
                reason = output.outputs[0].finish_reason if output.outputs else None
                self._report_finished(record, reason or "stop")
        if any_finished:
            # Ahead of the outputs, as the core process does: a client that reads /metrics or
            # /v1/usage after its answer sees its request counted.
            self._publish_snapshot()
        self._deliver(deliveries)

    def _fail_records(self, error: BaseException, reason: str) -> None:
        records = list(self._records.values())
        self._records.clear()
        for record in records:
            self._safe_abort(record.request_id, reason)
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

    def _safe_abort(self, request_id: str, reason: str = "abort") -> None:
        try:
            self.engine.abort(request_id, reason)
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

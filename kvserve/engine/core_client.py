"""CoreClient: the front end's side of the engine core process (kvserve/engine/core_process.py), an
EngineClient (kvserve/engine/client.py) for the HTTP server.

The core sends token ids; this side turns them into the cumulative RequestOutputs the serving code
reads: it detokenizes incrementally, matches stop strings (and tells the core to end a sample whose
text hit one, which frees its blocks), and keeps logprobs. Tokens the core produced after a stop it
had not heard of yet are dropped, so outputs are those of an in-process engine token for token.

The core process is watched through a pidfd on the event loop: when it exits, every open request
ends with EngineDeadError at once, `is_running` turns false, and `on_core_dead` runs (the launcher
then stops the server with a non-zero exit).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any, Callable, Optional

import zmq
import zmq.asyncio

from kvserve.engine import core_messages as msg
from kvserve.engine.client import (EngineDeadError, EngineShutdownError, EngineSnapshot, EngineStepError,
                                   FinishedRequest, RequestStream, ServedModel)
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.sched.scheduler import RequestForbidden, RequestRejected
from kvserve.sched.slo import RequestOverloaded

logger = logging.getLogger("kvserve.core_client")

_ADD_ERRORS: dict[str, type[BaseException]] = {
    "rejected": RequestRejected, "forbidden": RequestForbidden, "overloaded": RequestOverloaded, "invalid": ValueError,
    "shutting_down": EngineShutdownError, "internal": EngineStepError}


class _Sample:
    __slots__ = ("token_ids", "logprobs", "cumulative_logprob", "detokenizer", "finish_reason", "stop_reason")

    def __init__(self, detokenizer: Optional[IncrementalDetokenizer], logprobs: bool) -> None:
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[dict[int, float]]] = [] if logprobs else None
        self.cumulative_logprob = 0.0     # kept as tokens arrive (Request.cumulative_logprob says why)
        self.detokenizer = detokenizer
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int | str] = None


class RequestState:
    """One request's outputs as the front end rebuilds them from the core's deltas."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Any,
                 stream: RequestStream, arrival_time: float, tenant: Optional[str], priority: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stream = stream
        self.tenant = tenant
        self.priority = priority
        self.samples = [_Sample(IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                       params.stop, params.include_stop_str_in_output)
                                if tokenizer is not None else None, params.logprobs is not None)
                        for _ in range(params.n)]
        self.prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
        self.times: tuple = (arrival_time, None, None, None, 0)
        self.num_cached_tokens: Optional[int] = None
        self.phases: Optional[list] = None              # a traced request's, with its last delta
        self.last_output: Optional[RequestOutput] = None

    @property
    def finished(self) -> bool:
        return all(sample.finish_reason is not None for sample in self.samples)

    def apply(self, delta: msg.RequestDelta) -> list[tuple[int, str]]:
        """Takes the new tokens; returns the (sample, stop string) pairs the text stopped at."""
        self.times = delta.times
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.phases is not None:
            self.phases = delta.phases
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        stops = []
        for sd in delta.samples:
            sample = self.samples[sd.index]
            if sample.finish_reason is not None:
                continue            # already stopped here: the core had not heard yet
            last = len(sd.token_ids) - 1
            for position, token_id in enumerate(sd.token_ids):
                sample.token_ids.append(token_id)
                if sample.logprobs is not None and sd.logprobs is not None:
                    sample.logprobs.append(sd.logprobs[position])
                    sample.cumulative_logprob += sd.logprobs[position][token_id]
                hit = sample.detokenizer.append(token_id) if sample.detokenizer is not None else None
                # A token that both ends the sample in the core (length, EOS, a stop id) and
                # completes a stop string keeps the core's reason, as the in-process engine does.
                if hit is not None and not (position == last and sd.finish_reason is not None):
                    sample.finish_reason, sample.stop_reason = "stop", hit
                    stops.append((sd.index, hit))
                    break
            else:
                if sd.finish_reason is not None:
                    sample.finish_reason, sample.stop_reason = sd.finish_reason, sd.stop_reason
        return stops

    def output(self) -> RequestOutput:
        completions = []
        for index, sample in enumerate(self.samples):
            cumulative = sample.cumulative_logprob if sample.logprobs is not None else None
            completions.append(CompletionOutput(
                index=index, text=sample.detokenizer.text if sample.detokenizer is not None else "",
                token_ids=list(sample.token_ids), cumulative_logprob=cumulative,
                logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason))
        arrival, scheduled, first_token, finished_time, preemptions = self.times
        if self.finished and finished_time is None:
            finished_time = time.monotonic()
        metrics = RequestMetrics(arrival, scheduled, first_token, finished_time, preemptions)
        prompt_logprobs = self.prompt_logprobs if self.params.prompt_logprobs is not None else None
        self.last_output = RequestOutput(self.request_id, None, self.prompt_token_ids, prompt_logprobs, completions,
                                         self.finished, metrics, self.num_cached_tokens,
                                         self.phases if self.finished else None)
        return self.last_output


class CoreClient:
    """An EngineClient talking to the engine core process at `address` (a ZMQ endpoint)."""

    def __init__(self, address: str, core_pid: int, served: ServedModel, tokenizer: Any, *,
                 on_request_finished: Optional[Callable[[FinishedRequest], None]] = None,
                 on_core_dead: Optional[Callable[[], None]] = None) -> None:
        self.address = address
        self.core_pid = core_pid
        self.served = served
        self.tokenizer = tokenizer
        self.on_request_finished = on_request_finished
        self.on_core_dead = on_core_dead
        self._encode = msg.encoder().encode
        self._decode = msg.decoder_from_core().decode
        self._requests: dict[str, RequestState] = {}
        self._adds: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._snapshot = EngineSnapshot()
        self._accepting = False
        self._dead = False
        self._context: Optional[zmq.asyncio.Context] = None
        self._socket: Optional[zmq.asyncio.Socket] = None
        self._reader: Optional[asyncio.Task] = None
        self._pidfd: Optional[int] = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Connects and starts reading; call from the running event loop that serves requests."""
        loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        self._socket = socket
        self._send(msg.Hello(os.getpid()))
        self._accepting = True
        self._reader = loop.create_task(self._read())
        try:
            self._pidfd = os.pidfd_open(self.core_pid)
        except ProcessLookupError:
            self._core_died()
            return
        loop.add_reader(self._pidfd, self._core_died)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stops admitting, waits up to drain_timeout s for open requests, ends the rest with
        EngineShutdownError and disconnects. The core itself is stopped by the launcher."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, drain_timeout)
        while self._requests and not self._dead and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._requests and not self._dead:
            self._send(msg.Abort(list(self._requests)))
        self._fail_all(EngineShutdownError("the server shut down before this request finished"), "abort")
        self._close()

    def _close(self) -> None:
        if self._pidfd is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._pidfd)
            except RuntimeError:
                pass
            os.close(self._pidfd)
            self._pidfd = None
        if self._reader is not None:
            self._reader.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    @property
    def is_running(self) -> bool:
        return self._accepting and not self._dead

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # --- requests -------------------------------------------------------------------------------
    def open_stream(self) -> RequestStream:
        return RequestStream(self)

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *,
                          stream: Optional[RequestStream] = None, tenant: Optional[str] = None,
                          priority: int = 0, arrival_time: Optional[float] = None,
                          trace: bool = False) -> RequestStream:
        """As AsyncEngine.add_request; the prompt is a dict with prompt_token_ids (this side
        tokenizes) and the prefix-cache options (tenant, cache_salt, pin_ttl, pin_prefix_tokens)."""
        self._check_alive()
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise ValueError("the engine core takes token ids: tokenize the prompt first")
        if request_id in self._requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        ids = [int(t) for t in prompt["prompt_token_ids"]]
        try:
            payload = self._encode(msg.AddRequest(request_id, ids, params, arrival_time, prompt.get("tenant"),
                                                  prompt.get("cache_salt"), prompt.get("pin_ttl"),
                                                  prompt.get("pin_prefix_tokens"), priority, trace))
        except OverflowError:
            raise RequestRejected("an integer in the request is out of range (64 bits)") from None
        stream = stream or self.open_stream()
        state = RequestState(request_id, ids, params, self.tokenizer, stream, arrival_time, tenant, priority)
        done = asyncio.get_running_loop().create_future()
        self._adds[request_id] = done
        self._requests[request_id] = state
        stream._pending.add(request_id)
        self._socket.send(payload, copy=False)
        try:
            await done
        except BaseException as exc:
            stream._pending.discard(request_id)
            if self._requests.pop(request_id, None) is not None and isinstance(exc, asyncio.CancelledError):
                self._send(msg.Abort([request_id]))   # the caller went away while the add was in flight
            raise
        finally:
            self._adds.pop(request_id, None)
        return stream

    def abort(self, request_id: str) -> None:
        """Non-blocking; the core frees the request's blocks before its next step."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        if not self._dead:
            self._send(msg.Abort([request_id]))
        self._report_finished(state, "abort")

    async def pin_prefix(self, token_ids: list[int], ttl_s: float, tenant: Optional[str],
                         cache_salt: Optional[str], num_tokens: Optional[int]) -> dict[str, Any]:
        return await self._utility("pin_prefix", token_ids=token_ids, ttl_s=ttl_s, tenant=tenant,
                                   cache_salt=cache_salt, num_tokens=num_tokens)

    async def unpin_prefix(self, pin_id: int, tenant: Optional[str]) -> bool:
        if not -2 ** 63 <= pin_id < 2 ** 63:
            return False            # no pin has such an id (and msgpack has no such integer)
        return await self._utility("unpin_prefix", pin_id=pin_id, tenant=tenant)

    async def list_pins(self, tenant: Optional[str]) -> list[dict[str, Any]]:
        return await self._utility("list_pins", tenant=tenant)

    async def kv_map(self, **bounds: int) -> dict[str, Any]:
        return await self._utility("kv_map", **bounds)

    async def runtime_config(self) -> dict[str, Any]:
        return await self._utility("runtime_config")

    async def reconfigure(self, changes: dict[str, Any]) -> dict[str, Any]:
        return await self._utility("reconfigure", changes=changes)

    async def _utility(self, method: str, **args: Any) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        done = asyncio.get_running_loop().create_future()
        try:
            payload = self._encode(msg.Utility(call_id, method, args))
        except OverflowError:
            raise ValueError("an integer in the request is out of range (64 bits)") from None
        self._calls[call_id] = done
        self._socket.send(payload, copy=False)
        try:
            return await done
        finally:
            self._calls.pop(call_id, None)

    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDeadError("the engine core process has exited")
        if not self._accepting:
            raise EngineShutdownError("the engine is not accepting requests (shutting down or stopped)")

    def _send(self, message: Any) -> None:
        # zmq.asyncio sends at once when it can (always, with no high-water mark) and never blocks.
        if self._socket is not None:
            self._socket.send(self._encode(message), copy=False)

    # --- what the core sends --------------------------------------------------------------------
    async def _read(self) -> None:
        socket = self._socket
        while True:
            try:
                payload = await socket.recv(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                message = self._decode(payload.buffer)
            except Exception:
                logger.exception("undecodable message from the engine core (ignored)")
                continue
            try:
                self._dispatch(message)
            except Exception:
                logger.exception("failed to apply a message from the engine core")

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, msg.Step):
            self._take_step(message)
        elif isinstance(message, msg.Snapshot):
            self._snapshot = message.snapshot
        elif isinstance(message, msg.AddResult):
            done = self._adds.get(message.request_id)
            if done is None or done.done():
                return
            if message.error_kind is None:
                done.set_result(None)
            else:
                self._requests.pop(message.request_id, None)
                done.set_exception(_ADD_ERRORS.get(message.error_kind, EngineStepError)(message.message))
        elif isinstance(message, msg.UtilityResult):
            done = self._calls.get(message.call_id)
            if done is None or done.done():
                return
            if message.error_kind is None:
                done.set_result(message.result)
            else:
                done.set_exception((ValueError if message.error_kind == "invalid" else EngineStepError)(message.message))

    def _take_step(self, step: msg.Step) -> None:
        stops: list[msg.FinishSample] = []
        for delta in step.outputs:
            state = self._requests.get(delta.request_id)
            if state is None:
                continue          # aborted here, or already finished by a stop string
            if delta.error_kind is not None:
                del self._requests[delta.request_id]
                error = (EngineShutdownError if delta.error_kind == "shutting_down" else EngineStepError)(delta.error)
                state.stream._queue.put_nowait((delta.request_id, error))
                self._report_finished(state, "error")
                continue
            for index, stop in state.apply(delta):
                stops.append(msg.FinishSample(delta.request_id, index, stop))
            finished = state.finished
            if finished or state.params.output_kind == "cumulative":
                state.stream._queue.put_nowait((delta.request_id, state.output()))
            if finished:
                del self._requests[delta.request_id]
                reason = state.samples[0].finish_reason or "stop"
                self._report_finished(state, reason)
        for stop in stops:
            self._send(stop)

    def _core_died(self) -> None:
        if self._dead:
            return
        self._dead = True
        logger.error("the engine core process (pid %d) exited; failing %d open requests", self.core_pid,
                     len(self._requests))
        if self._pidfd is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._pidfd)
            except RuntimeError:
                pass
        error = EngineDeadError("the engine core process exited while this request was running")
        self._fail_all(error, "error")
        for done in list(self._adds.values()) + list(self._calls.values()):
            if not done.done():
                done.set_exception(EngineDeadError("the engine core process has exited"))
        if self.on_core_dead is not None:
            self.on_core_dead()

    def _fail_all(self, error: BaseException, reason: str) -> None:
        states = list(self._requests.values())
        self._requests.clear()
        for state in states:
            state.stream._queue.put_nowait((state.request_id, error))
            self._report_finished(state, reason)

    def _report_finished(self, state: RequestState, reason: str) -> None:
        if self.on_request_finished is None:
            return
        output = state.last_output
        arrival, scheduled, first_token, finished_time, _ = state.times
        samples = output.outputs if output is not None else []
        info = FinishedRequest(
            request_id=state.request_id, finish_reason=reason, arrival_time=arrival,
            first_scheduled_time=scheduled, first_token_time=first_token,
            finished_time=finished_time or time.monotonic(), num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=sum(len(s.token_ids) for s in samples),
            max_sample_tokens=max((len(s.token_ids) for s in samples), default=0),
            tenant=state.tenant, priority=state.priority)
        try:
            self.on_request_finished(info)
        except Exception:
            logger.exception("on_request_finished hook failed")

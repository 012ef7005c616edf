"""The engine core in a process of its own: `Engine.step()` in a loop, busy on the accelerator,
with the HTTP front ends in other processes (kvserve/engine/core_client.py; docs/server.md).

One ZMQ ROUTER socket carries everything: requests, aborts, stop-string finishes and pin calls in
from any number of front ends (DEALERs), and per step one message per front end with the new token
ids of all its requests. The core never detokenizes (the Engine runs with detokenize=False): text,
stop strings and SSE are the front ends' work, off this process's GIL.

Between steps the loop drains whatever has arrived without waiting; when the engine is idle it
sleeps in poll. It watches, through pidfds in the same poll: each front end (one that dies has its
requests aborted, their blocks freed at once), and the launcher (if it dies, the core exits: no
orphan holding the GPU).

Shutdown (SIGTERM, from the launcher): admissions stop, running requests get the drain timeout
to finish, the rest are aborted, and the process exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

import zmq

from kvserve.engine import core_messages as msg
from kvserve.engine.async_engine import served_model_of
from kvserve.engine.client import EngineSnapshot
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.runtime_config import reconfigure_reply
from kvserve.sched.scheduler import RequestForbidden, RequestRejected
from kvserve.sched.slo import RequestOverloaded

logger = logging.getLogger("kvserve.engine_core")

# How often the gauges go out while the engine is busy (an idle engine sends after every change).
SNAPSHOT_INTERVAL_S = 0.1
# poll timeout of an idle engine: how soon a SIGTERM is noticed when nothing else wakes the loop.
IDLE_POLL_MS = 200
# Idle while the cold KV tiers' writes drain: look again this often, so /metrics sees them land.
DRAIN_POLL_MS = 20


@dataclass
class _FrontEnd:
    identity: bytes
    pid: int
    pidfd: Optional[int]
    requests: set[str] = field(default_factory=set)


@dataclass
class _Sent:
    """What a request's front end already has: tokens per sample, and whether prompt logprobs went."""
    tokens: list[int]
    prompt_logprobs: bool = False


def _pidfd(pid: int) -> Optional[int]:
    """A descriptor that becomes readable when `pid` exits (Linux 5.3+); None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class EngineCore:
    """The step loop around one Engine and one bound ROUTER socket."""

    def __init__(self, engine: Any, socket: zmq.Socket, parent_pid: Optional[int] = None) -> None:
        self.engine = engine
        self.socket = socket
        self._encode = msg.encoder().encode
        self._decode = msg.decoder_to_core().decode
        self._poller = zmq.Poller()
        self._poller.register(socket, zmq.POLLIN)
        self._frontends: dict[bytes, _FrontEnd] = {}
        self._frontend_of_fd: dict[int, _FrontEnd] = {}
        self._owner: dict[str, _FrontEnd] = {}
        self._sent: dict[str, _Sent] = {}
        self._parent_fd = _pidfd(parent_pid) if parent_pid is not None else None
        if self._parent_fd is not None:
            self._poller.register(self._parent_fd, zmq.POLLIN)
        self._stopping = False
        self._drain_deadline = float("inf")
        self._num_steps = 0
        self._num_step_errors = 0
        self._snapshot_sent_at = float("-inf")
        self._changed = True
        self._was_draining = False
        self._utilities: dict[str, Callable[..., Any]] = {
            "pin_prefix": self._pin_prefix, "unpin_prefix": self._unpin_prefix, "list_pins": self._list_pins,
            "runtime_config": self._runtime_config, "reconfigure": self._reconfigure, "kv_map": self._kv_map}

    # --- the loop -------------------------------------------------------------------------------
    def request_stop(self, drain_timeout: float) -> None:
        if not self._stopping:
            logger.info("engine core: stopping, %d requests get %.1f s to finish", len(self._owner), drain_timeout)
        self._stopping = True
        self._drain_deadline = min(self._drain_deadline, time.monotonic() + max(0.0, drain_timeout))

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests() or engine.has_pending_tier_work
            draining = not busy and engine.tier_writes_in_flight
            if not self._poll(0 if busy else DRAIN_POLL_MS if draining else IDLE_POLL_MS):
                return                                    # the launcher is gone
            if self._stopping and (not engine.has_unfinished_requests() or time.monotonic() >= self._drain_deadline):
                self._abort_all("shutting_down", "the engine shut down before this request finished")
                self._send_snapshot()
                return
            if engine.has_unfinished_requests():
                self._step()
            elif engine.has_pending_tier_work:
                engine.flush_tiers()             # the last steps' blocks, down to disk / Redis now
                self._changed = True             # the tiers' counters moved: /metrics hears of it
            elif draining or self._was_draining:
                self._changed = True             # and once more after the last write landed
            self._was_draining = draining
            self._maybe_send_snapshot()

    def _poll(self, timeout_ms: int) -> bool:
        """Applies what has arrived; False when the launcher process has exited."""
        try:
            events = dict(self._poller.poll(timeout_ms))
        except zmq.ZMQError:
            events = {}       # interrupted by a signal: its handler has run; go round again
        if self._parent_fd is not None and self._parent_fd in events:
            logger.error("engine core: the server process exited; stopping")
            return False
        for fd, frontend in list(self._frontend_of_fd.items()):
            if fd in events:
                self._frontend_died(frontend)
        if self.socket in events:
            while True:
                try:
                    identity, payload = self.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._changed = True
                self._apply(identity, payload)
        return True

    def _apply(self, identity: bytes, payload: bytes) -> None:
        try:
            message = self._decode(payload)
        except Exception:
            logger.exception("engine core: undecodable message from a front end (ignored)")
            return
        frontend = self._frontends.get(identity)
        if isinstance(message, msg.Hello):
            self._hello(identity, message.pid)
        elif frontend is None:
            logger.error("engine core: a message from a front end that never said hello (ignored)")
        elif isinstance(message, msg.AddRequest):
            self._add(frontend, message)
        elif isinstance(message, msg.Abort):
            for request_id in message.request_ids:
                self._abort(request_id)
        elif isinstance(message, msg.FinishSample):
            if self.engine.finish_sample(message.request_id, message.index, message.stop_reason):
                self._forget(message.request_id)
        elif isinstance(message, msg.Utility):
            self._utility(frontend, message)

    def _hello(self, identity: bytes, pid: int) -> None:
        frontend = _FrontEnd(identity, pid, _pidfd(pid))
        self._frontends[identity] = frontend
        if frontend.pidfd is not None:
            self._frontend_of_fd[frontend.pidfd] = frontend
            self._poller.register(frontend.pidfd, zmq.POLLIN)
        self._send(frontend, msg.Snapshot(self._make_snapshot()))

    def _frontend_died(self, frontend: _FrontEnd) -> None:
        logger.error("engine core: front end pid %d exited; aborting its %d requests", frontend.pid,
                     len(frontend.requests))
        for request_id in list(frontend.requests):
            self._abort(request_id)
        self._frontends.pop(frontend.identity, None)
        if frontend.pidfd is not None:
            self._frontend_of_fd.pop(frontend.pidfd, None)
            self._poller.unregister(frontend.pidfd)
            os.close(frontend.pidfd)

    # --- requests -------------------------------------------------------------------------------
    def _add(self, frontend: _FrontEnd, add: msg.AddRequest) -> None:
        if self._stopping:
            self._send(frontend, msg.AddResult(add.request_id, "shutting_down", "the engine is shutting down"))
            return
        prompt = {"prompt_token_ids": add.prompt_token_ids}
        for key in ("tenant", "cache_salt", "pin_ttl", "pin_prefix_tokens"):
            value = getattr(add, key)
            if value is not None:
                prompt[key] = value
        try:
            self.engine.add_request(add.request_id, prompt, add.params, arrival_time=add.arrival_time,
                                    priority=add.priority, trace=add.trace)
        except RequestOverloaded as exc:
            self._send(frontend, msg.AddResult(add.request_id, "overloaded", str(exc)))
            return
        except RequestForbidden as exc:
            self._send(frontend, msg.AddResult(add.request_id, "forbidden", str(exc)))
            return
        except RequestRejected as exc:
            self._send(frontend, msg.AddResult(add.request_id, "rejected", str(exc)))
            return
        except ValueError as exc:
            self._send(frontend, msg.AddResult(add.request_id, "invalid", str(exc)))
            return
        except Exception as exc:
            logger.exception("engine core: add_request failed")
            self._send(frontend, msg.AddResult(add.request_id, "internal", f"the engine could not take the request "
                                                                          f"({type(exc).__name__})"))
            return
        self._owner[add.request_id] = frontend
        self._sent[add.request_id] = _Sent([0] * add.params.n)
        frontend.requests.add(add.request_id)
        self._send(frontend, msg.AddResult(add.request_id))

    def _abort(self, request_id: str, reason: str = "abort") -> None:
        try:
            self.engine.abort(request_id, reason)
        except Exception:
            logger.exception("engine core: abort(%s) failed", request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        frontend = self._owner.pop(request_id, None)
        self._sent.pop(request_id, None)
        if frontend is not None:
            frontend.requests.discard(request_id)

    def _abort_all(self, kind: str, why: str) -> None:
        """Every request ends with an error (`kind`, in words `why`; its front end raises it), and
        its blocks are freed. A failed step's requests count as errors, a shutdown's as aborted."""
        reason = "error" if kind == "step_failed" else "abort"
        by_frontend: dict[bytes, list[msg.RequestDelta]] = {}
        for request_id, frontend in list(self._owner.items()):
            by_frontend.setdefault(frontend.identity, []).append(
                msg.RequestDelta(request_id, [], True, (0.0, None, None, None, 0), error_kind=kind, error=why))
            self._abort(request_id, reason)
        for identity, deltas in by_frontend.items():
            frontend = self._frontends.get(identity)
            if frontend is not None:
                self._send(frontend, msg.Step(deltas))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._num_step_errors += 1
            logger.exception("engine step failed; aborting the %d requests in the engine", len(self._owner))
            self._abort_all("step_failed", f"the engine failed while running this request ({type(exc).__name__})")
            return
        self._num_steps += 1
        self._changed = True
        by_frontend: dict[bytes, list[msg.RequestDelta]] = {}
        any_finished = False
        for output in outputs:
            frontend = self._owner.get(output.request_id)
            if frontend is None:
                continue          # aborted after this step began
            by_frontend.setdefault(frontend.identity, []).append(self._delta(output))
            if output.finished:
                any_finished = True
                self._forget(output.request_id)
        if any_finished:
            # Ahead of the outputs: a client that reads /metrics after its answer sees its request counted.
            self._send_snapshot()
        for identity, deltas in by_frontend.items():
            frontend = self._frontends.get(identity)
            if frontend is not None:
                self._send(frontend, msg.Step(deltas))

    def _delta(self, output: RequestOutput) -> msg.RequestDelta:
        sent = self._sent[output.request_id]
        samples = []
        for sample in output.outputs:
            start = sent.tokens[sample.index]
            if len(sample.token_ids) == start and sample.finish_reason is None:
                continue
            sent.tokens[sample.index] = len(sample.token_ids)
            samples.append(msg.SampleDelta(sample.index, sample.token_ids[start:],
                                           sample.logprobs[start:] if sample.logprobs is not None else None,
                                           sample.finish_reason, sample.stop_reason))
        prompt_logprobs = None
        if output.prompt_logprobs is not None and not sent.prompt_logprobs:
            prompt_logprobs, sent.prompt_logprobs = output.prompt_logprobs, True
        m = output.metrics
        times = ((m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time, m.num_preemptions)
                 if m is not None else (0.0, None, None, None, 0))
        return msg.RequestDelta(output.request_id, samples, output.finished, times, prompt_logprobs,
                                num_cached_tokens=output.num_cached_tokens, phases=output.phases)

    # --- utilities (pins) -----------------------------------------------------------------------
    def _utility(self, frontend: _FrontEnd, call: msg.Utility) -> None:
        method = self._utilities.get(call.method)
        if method is None:
            self._send(frontend, msg.UtilityResult(call.call_id, None, "invalid", f"no utility {call.method!r}"))
            return
        try:
            result = method(**call.args)
        except ValueError as exc:
            self._send(frontend, msg.UtilityResult(call.call_id, None, "invalid", str(exc)))
            return
        except Exception as exc:
            logger.exception("engine core: utility %s failed", call.method)
            self._send(frontend, msg.UtilityResult(call.call_id, None, "internal", type(exc).__name__))
            return
        self._send(frontend, msg.UtilityResult(call.call_id, result))

    def _pin_prefix(self, token_ids: list[int], ttl_s: float, tenant: Optional[str], cache_salt: Optional[str],
                    num_tokens: Optional[int]) -> dict[str, Any]:
        return self.engine.pin_prefix({"prompt_token_ids": token_ids}, ttl_s, tenant=tenant, cache_salt=cache_salt,
                                      num_tokens=num_tokens).as_dict()

    def _unpin_prefix(self, pin_id: int, tenant: Optional[str]) -> bool:
        return self.engine.unpin_prefix(pin_id, tenant=tenant)

    def _list_pins(self, tenant: Optional[str]) -> list[dict[str, Any]]:
        return [pin.as_dict() for pin in self.engine.prefix.pins(tenant)]

    def _kv_map(self, **bounds: int) -> dict[str, Any]:
        return self.engine.make_kv_map(**bounds).as_dict()

    # --- utilities (run-time config: the admin config API) ---------------------------------------
    def _runtime_config(self) -> dict[str, Any]:
        return self.engine.runtime_config()

    def _reconfigure(self, changes: dict[str, Any]) -> dict[str, Any]:
        reply = reconfigure_reply(self.engine, changes)
        self._send_snapshot()       # /metrics and the page see the change before the caller's answer
        return reply

    # --- the gauges -----------------------------------------------------------------------------
    def _make_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.from_stats(self.engine.make_stats(), self._num_steps, self._num_step_errors, 0)

    def _maybe_send_snapshot(self) -> None:
        now = time.monotonic()
        busy = self.engine.has_unfinished_requests()
        if (busy and now - self._snapshot_sent_at >= SNAPSHOT_INTERVAL_S) or (not busy and self._changed):
            self._send_snapshot()

    def _send_snapshot(self) -> None:
        try:
            payload = self._encode(msg.Snapshot(self._make_snapshot()))
        except Exception:
            logger.exception("engine core: could not read engine state for the snapshot")
            return
        self._snapshot_sent_at, self._changed = time.monotonic(), False
        for frontend in self._frontends.values():
            self.socket.send_multipart([frontend.identity, payload], copy=False)

    def _send(self, frontend: _FrontEnd, message: Any) -> None:
        self.socket.send_multipart([frontend.identity, self._encode(message)], copy=False)


def bind_router(context: zmq.Context, address: str) -> zmq.Socket:
    socket = context.socket(zmq.ROUTER)
    # Unbounded queues: a token message is never dropped; a front end that stops reading is one that
    # died, and its pidfd says so.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(address)
    return socket


def run_engine_core(engine_options: dict[str, Any], address: str, parent_pid: int, ready: Connection,
                    log_level: str = "info", drain_timeout: float = 30.0) -> None:
    """The process entry (multiprocessing, spawn): builds the engine, reports ("ready", facts) or
    ("error", message) on `ready`, then serves until stopped. Exits 0 after a clean stop."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the launcher decides how the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    core_holder: list[EngineCore] = []
    stop_asked = []

    def on_sigterm(signum: int, frame: Any) -> None:
        if core_holder:
            core_holder[0].request_stop(drain_timeout)
        else:
            stop_asked.append(signum)
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        from kvserve.engine.engine import Engine, freeze_startup_objects
        from kvserve.config import EngineConfig
        engine = Engine(EngineConfig.from_options(**engine_options), detokenize=False)
        freeze_startup_objects()
        context = zmq.Context()
        socket = bind_router(context, address)
    except BaseException as exc:
        logger.exception("engine core: startup failed")
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    ready.send(("ready", msg.encoder().encode(served_model_of(engine))))
    ready.close()
    core = EngineCore(engine, socket, parent_pid)
    core_holder.append(core)
    if stop_asked:
        core.request_stop(drain_timeout)
    try:
        core.run()
    except BaseException:
        logger.exception("engine core: the loop crashed")
        os._exit(1)
    engine.close()                  # the cold KV tiers' last writes (a restarted server finds them)
    socket.close(linger=0)
    context.term()
    logger.info("engine core: stopped after %d steps", core._num_steps)

"""AsyncEngine against a scripted fake engine: threading, idle wait, step errors, aborts, shutdown.

The fake has the Engine surface AsyncEngine uses (add_request / step / abort / has_unfinished_requests
plus the gauges of the metrics snapshot), makes one token per request per step, and can be told to
sleep or raise inside step(), which is what the real engine cannot be made to do on demand.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from kvserve.engine.async_engine import AsyncEngine, EngineShutdownError, EngineStepError, FinishedRequest
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.stats import EngineStats, KVCacheStats, SchedulerStats


class FakeEngine:
    def __init__(self, step_seconds: float = 0.0) -> None:
        self.step_seconds = step_seconds
        self.requests: dict[str, dict] = {}
        self.fail_next_steps = 0
        self.aborted: list[str] = []
        self.step_calls = 0
        self.poll_calls = 0
        self.thread_ids: set[int] = set()
        self.kv_manager = SimpleNamespace(num_blocks=100, num_free_blocks=100, usage=0.0, capacity_tokens=1600)
        self.stats = SimpleNamespace(prompt_tokens_total=0, generation_tokens_total=0, requests_finished_total={})
        self.scheduler = SimpleNamespace(num_preemptions_total=0, slo=None)

    # No KV tiers below the host: nothing to hand down between requests, nothing to finish at close.
    has_pending_tier_work = False

    def flush_tiers(self) -> None:
        pass

    def close(self) -> None:
        self._touch()

    def make_stats(self) -> EngineStats:
        kv, stats = self.kv_manager, self.stats
        return EngineStats(SchedulerStats(len(self.requests), 0, 0),
                           KVCacheStats(kv.num_blocks, kv.num_free_blocks, kv.usage, kv.capacity_tokens),
                           stats.prompt_tokens_total, stats.generation_tokens_total, dict(stats.requests_finished_total))

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0, trace=False):
        self._touch()
        ids = prompt["prompt_token_ids"]
        if not ids:
            raise ValueError("the prompt is empty")
        self.requests[request_id] = {"prompt": ids, "out": [], "max": params.max_tokens, "t0": time.monotonic()}
        self.kv_manager.num_free_blocks -= 1
        self.stats.prompt_tokens_total += len(ids)
        return request_id

    def abort(self, request_id, reason="abort"):
        self._touch()
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)
            self.kv_manager.num_free_blocks += 1

    def has_unfinished_requests(self):
        self._touch()
        self.poll_calls += 1
        return bool(self.requests)

    @property
    def num_running(self):
        return len(self.requests)

    @property
    def num_waiting(self):
        return 0

    def step(self):
        self._touch()
        self.step_calls += 1
        if self.step_seconds:
            time.sleep(self.step_seconds)
        if self.fail_next_steps and len(self.requests) >= 2:   # fail once both test requests are in
            self.fail_next_steps -= 1
            raise RuntimeError("simulated kernel failure")
        outputs, now = [], time.monotonic()
        for request_id, state in list(self.requests.items()):
            state["out"].append(len(state["out"]))
            state.setdefault("t1", now)
            finished = len(state["out"]) >= state["max"]
            sample = CompletionOutput(0, "x" * len(state["out"]), list(state["out"]), None, None,
                                      "length" if finished else None)
            outputs.append(RequestOutput(request_id, None, state["prompt"], None, [sample], finished,
                                         RequestMetrics(state["t0"], state["t0"], state["t1"],
                                                        now if finished else None)))
            self.stats.generation_tokens_total += 1
            if finished:
                del self.requests[request_id]
                self.kv_manager.num_free_blocks += 1
        return outputs


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def _drain(stream):
    last = None
    async for output in stream:
        last = output
    return last


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


def test_outputs_stream_and_the_engine_runs_on_one_thread():
    engine = FakeEngine()
    finished: list[FinishedRequest] = []

    async def main():
        async_engine = AsyncEngine(engine, on_request_finished=finished.append)
        async_engine.start()
        streams = [await async_engine.add_request(f"r{i}", {"prompt_token_ids": [1, 2, 3]}, _params(5 + i))
                   for i in range(4)]
        finals = await asyncio.gather(*(_drain(s) for s in streams))
        value = await async_engine.call(lambda e: e.kv_manager.num_free_blocks)
        await async_engine.shutdown(drain_timeout=1)
        return finals, value, async_engine.snapshot

    finals, free_blocks, snapshot = run(main())
    assert [len(f.outputs[0].token_ids) for f in finals] == [5, 6, 7, 8]
    assert all(f.finished for f in finals)
    assert free_blocks == 100
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids
    assert sorted(f.request_id for f in finished) == ["r0", "r1", "r2", "r3"]
    assert all(f.finish_reason == "length" and f.first_token_time is not None for f in finished)
    assert snapshot.generation_tokens_total == 26 and snapshot.num_free_blocks == 100


def test_event_loop_keeps_running_during_slow_steps():
    engine = FakeEngine(step_seconds=0.15)

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        stream = await async_engine.add_request("slow", {"prompt_token_ids": [1]}, _params(6))
        gaps, last = [], time.monotonic()
        task = asyncio.ensure_future(_drain(stream))
        while not task.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        await async_engine.shutdown(drain_timeout=1)
        return max(gaps), len(gaps)

    max_gap, ticks = run(main())
    assert ticks > 30            # ~0.9 s of steps; the loop ticked all along
    assert max_gap < 0.1         # never blocked for a whole 0.15 s step


def test_idle_engine_does_not_spin():
    engine = FakeEngine()

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        await _drain(await async_engine.add_request("a", {"prompt_token_ids": [1]}, _params(2)))
        polls_before = engine.poll_calls
        await asyncio.sleep(0.5)
        polls_idle = engine.poll_calls - polls_before
        # A command wakes the idle thread at once.
        started = time.monotonic()
        await _drain(await async_engine.add_request("b", {"prompt_token_ids": [1]}, _params(1)))
        wake = time.monotonic() - started
        await async_engine.shutdown(drain_timeout=1)
        return polls_idle, wake

    polls_idle, wake = run(main())
    assert polls_idle <= 2
    assert wake < 0.5


def test_rejected_request_raises_to_its_caller_only():
    engine = FakeEngine()

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        with pytest.raises(ValueError, match="empty"):
            await async_engine.add_request("bad", {"prompt_token_ids": []}, _params(2))
        final = await _drain(await async_engine.add_request("good", {"prompt_token_ids": [1]}, _params(3)))
        await async_engine.shutdown(drain_timeout=1)
        return final

    assert len(run(main()).outputs[0].token_ids) == 3


def test_step_error_goes_to_the_affected_requests_and_the_loop_goes_on():
    engine = FakeEngine()
    finished: list[FinishedRequest] = []

    async def main():
        async_engine = AsyncEngine(engine, on_request_finished=finished.append)
        async_engine.start()
        await async_engine.call(lambda e: setattr(e, "fail_next_steps", 1))
        streams = [await async_engine.add_request(f"r{i}", {"prompt_token_ids": [1]}, _params(100_000))
                   for i in range(2)]
        errors = []
        for stream in streams:
            with pytest.raises(EngineStepError) as info:
                await _drain(stream)
            errors.append(str(info.value))
        after = await _drain(await async_engine.add_request("next", {"prompt_token_ids": [1]}, _params(3)))
        await async_engine.shutdown(drain_timeout=1)
        return errors, after, async_engine.snapshot

    errors, after, snapshot = run(main())
    assert all("RuntimeError" in e and "simulated" not in e for e in errors)   # no internals leak
    assert sorted(engine.aborted) == ["r0", "r1"]                            # their blocks came back
    assert len(after.outputs[0].token_ids) == 3
    assert snapshot.num_step_errors_total == 1 and snapshot.num_free_blocks == 100
    assert sorted(f.finish_reason for f in finished) == ["error", "error", "length"]


def test_abort_frees_the_request_and_reports_it():
    engine = FakeEngine(step_seconds=0.01)
    finished: list[FinishedRequest] = []

    async def main():
        async_engine = AsyncEngine(engine, on_request_finished=finished.append)
        async_engine.start()
        stream = await async_engine.add_request("long", {"prompt_token_ids": [1]}, _params(10_000))
        await stream.__anext__()
        stream.abort()
        for _ in range(100):
            if await async_engine.call(lambda e: not e.requests):
                break
            await asyncio.sleep(0.01)
        await async_engine.shutdown(drain_timeout=1)

    run(main())
    assert engine.aborted == ["long"] and engine.kv_manager.num_free_blocks == 100
    assert [f.finish_reason for f in finished] == ["abort"]


def test_shutdown_drains_short_requests_and_errors_long_ones():
    engine = FakeEngine(step_seconds=0.01)

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        short = await async_engine.add_request("short", {"prompt_token_ids": [1]}, _params(5))
        long = await async_engine.add_request("long", {"prompt_token_ids": [1]}, _params(100_000))
        short_task = asyncio.ensure_future(_drain(short))
        long_task = asyncio.ensure_future(_drain(long))
        started = time.monotonic()
        await async_engine.shutdown(drain_timeout=0.3, join_timeout=5)
        elapsed = time.monotonic() - started
        short_result = await short_task
        with pytest.raises(EngineShutdownError):
            await long_task
        with pytest.raises(EngineShutdownError):
            await async_engine.add_request("late", {"prompt_token_ids": [1]}, _params(1))
        return short_result, elapsed, async_engine

    short_result, elapsed, async_engine = run(main())
    assert short_result.finished and len(short_result.outputs[0].token_ids) == 5
    assert elapsed < 3
    assert not async_engine.is_running and not async_engine._thread.is_alive()
    assert "long" in engine.aborted

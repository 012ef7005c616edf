"""Latency targets (kvserve/engine/slo.py): the TPOT running limit, TTFT shedding at arrival and in
the queue, on the controller alone (a fake clock) and through the engine on a tiny model."""

from __future__ import annotations

import pytest

from conftest import TEST_DEVICE, requires_default_model
from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.slo import (DECREASE_FACTOR, INCREASE_STEP, TPOT_MARGIN, RequestOverloaded, SLOController,
                                SLOTargets)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _controller(**targets) -> tuple[SLOController, FakeClock]:
    clock = FakeClock()
    return SLOController(SLOTargets(**targets), max_num_seqs=64, clock=clock), clock


# --------------------------------------------------------------------------------------------------
# the controller alone
# --------------------------------------------------------------------------------------------------

def test_running_limit_drops_from_what_runs_when_steps_are_too_slow():
    slo, _ = _controller(tpot_s=0.2)
    assert slo.max_running == 64
    slo.observe_step(0.3, num_running=20)          # over 0.2 * margin
    assert slo.max_running == int(20 * DECREASE_FACTOR)
    for _ in range(50):                                           # no further cut while 20 still run
        slo.observe_step(0.3, num_running=20)
    assert slo.max_running == int(20 * DECREASE_FACTOR)
    running = 20
    for _ in range(50):                                           # the batch shrinks to each new limit
        running = min(running, slo.max_running)
        slo.observe_step(0.3, num_running=running)
    assert slo.max_running == 1                                    # never below one request


def test_running_limit_grows_only_while_it_binds():
    slo, _ = _controller(tpot_s=0.2)
    slo.observe_step(0.5, num_running=10)
    fast = 0.2 * TPOT_MARGIN * 0.5
    while slo.step_time_s > 0.2 * TPOT_MARGIN:                     # the smoothed time falls under the target
        slo.observe_step(fast, num_running=slo.max_running)
    limit = slo.max_running
    assert 1 < limit < 10
    for _ in range(30):
        slo.observe_step(fast, num_running=limit - 1)   # the limit does not bind: no reason to grow
    assert slo.max_running == limit
    steps = int(4 / INCREASE_STEP)
    for _ in range(steps):
        slo.observe_step(fast, num_running=slo.max_running)
    assert slo.max_running == limit + 4
    for _ in range(1000):
        slo.observe_step(fast, num_running=slo.max_running)
    assert slo.max_running == 64                                   # capped by max_num_seqs


def test_no_tpot_target_means_no_limit():
    slo, _ = _controller(ttft_s=2.0, shed=True)
    for _ in range(20):
        slo.observe_step(5.0, num_running=30)
    assert slo.max_running == 64
    assert slo.step_time_s == pytest.approx(5.0)


def test_arrival_rejection_predicts_the_wait_from_the_completion_rate():
    slo, clock = _controller(ttft_s=2.0, shed=True)
    assert slo.reject_at_arrival(num_ahead=100, num_prompt_tokens=10, token_budget=512) is None   # no rate yet
    for _ in range(5):                        # 5 completions over 4 s: 1.25 per second
        slo.observe_completion()
        clock.now += 1.0
    clock.now -= 1.0
    assert slo.completion_rate() == pytest.approx(1.25)
    assert slo.reject_at_arrival(num_ahead=1, num_prompt_tokens=10, token_budget=512) is None      # 1.6 s
    reason = slo.reject_at_arrival(num_ahead=2, num_prompt_tokens=10, token_budget=512)            # 2.4 s
    assert reason is not None and "overloaded" in reason and "3 running requests must finish" in reason
    assert slo.num_rejected_at_arrival == 1
    clock.now += 60.0                          # the window forgets old completions
    assert slo.completion_rate() is None


def test_arrival_rejection_counts_the_prompts_own_steps():
    slo, clock = _controller(ttft_s=2.0, shed=True)
    for _ in range(5):
        slo.observe_completion()
        clock.now += 1.0
    clock.now -= 1.0
    slo.observe_step(0.25, num_running=4)
    # 0.8 s of queue + one 0.25 s step fits; a prompt needing 6 steps of a 100-token budget does not.
    assert slo.reject_at_arrival(num_ahead=0, num_prompt_tokens=100, token_budget=100) is None
    assert slo.reject_at_arrival(num_ahead=0, num_prompt_tokens=600, token_budget=100) is not None


def test_shedding_is_off_unless_asked_for():
    slo, clock = _controller(ttft_s=0.5)
    for _ in range(5):
        slo.observe_completion()
        clock.now += 1.0
    assert slo.reject_at_arrival(num_ahead=50, num_prompt_tokens=10, token_budget=512) is None
    assert not slo.missed_deadline(arrival_time=0.0, num_prompt_tokens=10, token_budget=512, now=clock.now)


def test_in_queue_deadline():
    slo, _ = _controller(ttft_s=2.0, shed=True)
    slo.observe_step(0.5, num_running=1)
    # Late once the first token, one 0.5 s step after now, would come after 0.9 x the 2 s target.
    assert not slo.missed_deadline(arrival_time=10.0, num_prompt_tokens=10, token_budget=512, now=11.2)
    assert slo.missed_deadline(arrival_time=10.0, num_prompt_tokens=10, token_budget=512, now=11.4)


def test_slo_outcomes_of_finished_requests():
    from kvserve.engine.async_engine import EngineSnapshot, FinishedRequest
    from kvserve.obs.metrics import ServerMetrics

    metrics = ServerMetrics(lambda: EngineSnapshot(), "m", slo=SLOTargets(ttft_s=1.0, tpot_s=0.1))

    def finish(ttft: float, tokens: int, e2e: float) -> None:
        metrics.observe_finished(FinishedRequest(
            request_id="r", finish_reason="stop", arrival_time=10.0, first_scheduled_time=10.0,
            first_token_time=10.0 + ttft, finished_time=10.0 + e2e, num_prompt_tokens=5,
            num_generation_tokens=tokens, max_sample_tokens=tokens, tenant=None, priority=0))

    finish(0.5, 11, 1.4)       # TPOT 0.09
    finish(1.5, 11, 2.4)       # late first token
    finish(0.5, 11, 2.0)       # TPOT 0.15
    finish(2.0, 3, 3.0)        # both
    finish(0.2, 1, 0.2)        # one token: no TPOT to miss
    text = metrics.render().decode()
    for outcome, count in (("met", 2), ("missed_ttft", 1), ("missed_tpot", 1), ("missed_both", 1)):
        assert f'kvserve:requests_slo_total{{model_name="m",outcome="{outcome}"}} {count:.1f}' in text
    assert "requests_slo_total" not in ServerMetrics(lambda: EngineSnapshot(), "m").render().decode()


def test_config_checks():
    with pytest.raises(ValueError, match="slo_shed needs slo_ttft"):
        EngineConfig.from_options(slo_shed=True)
    with pytest.raises(ValueError, match="slo_tpot must be > 0"):
        EngineConfig.from_options(slo_tpot=0.0)


# --------------------------------------------------------------------------------------------------
# through the engine
# --------------------------------------------------------------------------------------------------

def _engine(folder: str, **options) -> Engine:
    return Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=2 << 20,
                               block_size=16, max_model_len=256, **options)


def _run(engine: Engine, track_running: bool = False) -> tuple[dict, int]:
    outputs, most_running = {}, 0
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return outputs, most_running
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        most_running = max(most_running, engine.num_running)
    raise AssertionError("engine did not finish its requests")


PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 41] for i in range(6)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    engine = _engine(folder)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    outputs, _ = _run(engine)
    return {key: output.outputs[0].token_ids for key, output in outputs.items()}


def test_late_waiting_requests_are_shed_and_the_rest_is_unchanged(tiny_checkpoint, reference):
    folder, _ = tiny_checkpoint
    engine = _engine(folder, slo_ttft=2.0, slo_shed=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2 if i == 2 else 1))
    for request_id in ("1", "2#0", "2#1"):       # they have waited 10 s already
        engine.scheduler.requests[request_id].arrival_time -= 10.0
    outputs, _ = _run(engine)
    assert outputs["0"].outputs[0].token_ids == reference["0"]
    for key, samples in (("1", 1), ("2", 2)):
        assert len(outputs[key].outputs) == samples
        assert all(s.finish_reason == "rejected" and s.token_ids == [] for s in outputs[key].outputs)
    assert engine.scheduler.slo.num_rejected_in_queue == 3      # counted per sample, as finishes are
    assert engine.stats.requests_finished_total == {"length": 1, "rejected": 3}
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_arrival_rejection_through_the_engine(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    engine = _engine(folder, slo_ttft=1.0, slo_shed=True, max_num_seqs=2)
    clock = FakeClock()
    engine.scheduler.slo.clock = clock
    for _ in range(4):                            # 4 completions over 6 s: 0.67 per second
        engine.scheduler.slo.observe_completion()
        clock.now += 2.0
    # A slow completion rate says nothing while there is room: both are admitted at the next step,
    # although b arrives with a still queued.
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    with pytest.raises(RequestOverloaded, match="TTFT target"):
        engine.add_request("c", {"prompt_token_ids": PROMPTS[2]}, GREEDY)  # needs a or b to finish: ~1.5 s
    assert set(engine.scheduler.requests) == {"a", "b"}
    _run(engine)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_tpot_limit_holds_admissions_and_keeps_outputs(tiny_checkpoint, reference):
    folder, _ = tiny_checkpoint
    # A target no step can meet: the limit falls to one request once steps are measured.
    engine = _engine(folder, slo_tpot=1e-9, max_num_seqs=4)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    first, most_running = _run(engine)
    assert most_running == 2                      # admitted before any step was measured
    assert engine.scheduler.slo.max_running == 1  # cut from the 2 that ran
    for i, prompt in enumerate(PROMPTS[2:], start=2):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    second, most_running = _run(engine)
    assert most_running == 1
    outputs = {**first, **second}
    assert {key: output.outputs[0].token_ids for key, output in outputs.items()} == reference


# --------------------------------------------------------------------------------------------------
# through the server: HTTP 503 "overloaded", in the queue and at arrival
# --------------------------------------------------------------------------------------------------

@requires_default_model      # the tiny model borrows the default model's tokenizer
def test_server_answers_shed_requests_with_503_and_keeps_serving(tmp_path):
    import json
    import threading
    import time

    import httpx

    from loopback_server import LoopbackServer, build_tiny_chat_model

    folder = build_tiny_chat_model(tmp_path / "tiny", max_position_embeddings=4096)
    engine = Engine.from_options(model=folder, max_model_len=4096, kv_cache_memory=16 << 20, max_num_seqs=1,
                                 slo_ttft=0.2, slo_shed=True)
    server = LoopbackServer(engine)
    try:
        url = server.url + "/v1/completions"
        # One long request holds the only running slot; whoever comes next must queue behind it.
        long_body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        stop_long = threading.Event()

        def long_stream() -> None:
            with httpx.stream("POST", url, json=long_body, timeout=60) as response:
                for _ in response.iter_lines():
                    if stop_long.is_set():
                        return        # closing the connection aborts the request

        holder = threading.Thread(target=long_stream)
        holder.start()
        deadline = time.monotonic() + 30
        while server.snapshot.num_running < 1:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.01)

        short = {"model": "tiny", "prompt": "Hi there", "max_tokens": 4}
        response = httpx.post(url, json=short, timeout=30)                    # shed at its deadline
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "overloaded" and "TTFT target" in error["message"]

        with httpx.stream("POST", url, json={**short, "stream": True}, timeout=30) as streamed:
            assert streamed.status_code == 200     # SSE had begun: the error comes as an event
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "overloaded"

        # Completions at 0.5/s predict a 2 s wait behind the long request: rejected at arrival.
        clock = FakeClock()
        clock.now = time.monotonic()
        engine.scheduler.slo.clock = clock
        for _ in range(4):
            engine.scheduler.slo.observe_completion()
            clock.now += 2.0
        clock.now -= 2.0
        response = httpx.post(url, json=short, timeout=30)
        assert response.status_code == 503 and "must finish before this one starts" in response.json()["error"]["message"]

        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        from kvserve.obs.metrics import SLO_METRIC_NAMES
        assert all(name in metrics for name in SLO_METRIC_NAMES)
        assert 'kvserve:requests_shed_total{model_name="tiny",where="queue"} 2.0' in metrics
        assert 'kvserve:requests_shed_total{model_name="tiny",where="arrival"} 1.0' in metrics
        assert 'kvserve:request_success_total{finished_reason="rejected",model_name="tiny"} 2.0' in metrics

        stop_long.set()
        holder.join(30)
        deadline = time.monotonic() + 30
        while server.snapshot.num_running or server.snapshot.num_waiting:
            assert time.monotonic() < deadline, "the long request was not aborted"
            time.sleep(0.01)
        response = httpx.post(url, json=short, timeout=30)                    # an idle server admits at once
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        # Only finished requests are judged: shed and aborted ones are not; this one was in time.
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'kvserve:requests_slo_total{model_name="tiny",outcome="met"} 1.0' in metrics
        assert 'kvserve:requests_slo_total{model_name="tiny",outcome="missed_ttft"} 0.0' in metrics
        assert server.snapshot.num_free_blocks == server.snapshot.num_blocks
    finally:
        server.stop()

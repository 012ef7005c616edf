"""Overlapped scheduling (`async_scheduling`): a step is launched before the previous step's tokens
reach the host; the results must be those of the synchronous engine, token for token.

On CUDA the overlap is real; on CPU `async_scheduling="on"` runs the same bookkeeping (pending
tokens, device-fed inputs, one-step-late outputs) with a synchronous device, so CI checks it too.
"""

from __future__ import annotations

import pytest

from conftest import TEST_DEVICE
from kvserve import SamplingParams
from kvserve.engine.engine import Engine
from kvserve.sched.request import PENDING_TOKEN

PROMPTS = [[1, 17, 42, 99, 3], [1, 5], [1] + list(range(30, 75)), [1, 200, 201, 202, 203, 204, 205]]


def _engine(folder: str, mode: str, **overrides) -> Engine:
    options = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=2 << 20, block_size=16,
                   max_model_len=256, async_scheduling=mode)
    options.update(overrides)
    return Engine.from_options(**options)


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]], abort_after: dict | None = None):
    """{request id: (token ids, finish reason)} with every request finished; aborts the given ids
    once their step count is reached."""
    ids = [engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
           for i, (prompt, params) in enumerate(requests)]
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 2_000, "engine did not finish"
        for request_id, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(request_id)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [(c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert engine.kv_manager.num_tracked_requests == 0
    return ids, finished


def _mixed_requests(stop_token: int) -> list[tuple[list[int], SamplingParams]]:
    return [
        (PROMPTS[0], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)),      # done at prefill
        (PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token])),
        (PROMPTS[3], SamplingParams(max_tokens=17, temperature=0.8, seed=11, ignore_eos=True)),
        (PROMPTS[0], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)),
        (PROMPTS[3], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=4)),
    ]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """The synchronous engine's results, and a token that request 2 produces mid-way (a stop id)."""
    folder, _ = tiny_checkpoint
    sync = _engine(folder, "off")
    _, probe = _run(sync, [(PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))])
    stop_token = probe["r0"][0][0][7]
    _, finished = _run(sync, _mixed_requests(stop_token))
    return stop_token, finished


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(max_num_batched_tokens=8),        # chunked prefill: requests go from chunks to decodes mid-flight
    dict(max_num_seqs=2),                  # admissions while earlier requests still have pending tokens
    dict(enforce_eager=True),              # on CUDA: the eager path's device feed instead of the graphs'
], ids=["plain", "chunked-prefill", "two-seqs", "eager"])
def test_async_matches_sync(tiny_checkpoint, reference, overrides):
    folder, _ = tiny_checkpoint
    stop_token, expected = reference
    _, got = _run(_engine(folder, "on", **overrides), _mixed_requests(stop_token))
    assert got == expected
    assert got["r2"][0][1] == "stop" and got["r2"][0][2] == stop_token      # the stop id ended it early
    assert [len(c[0]) for c in got["r4"]] == [6, 6, 6] and len(got["r0"][0][0]) == 9


def test_async_with_preemption_matches_sync(tiny_checkpoint, reference):
    """A pool too small for all requests at once: preemption (recompute) never sees a pending token."""
    folder, _ = tiny_checkpoint
    stop_token, expected = reference
    per_token = _engine(folder, "off").kv_bytes_per_token
    engine = _engine(folder, "on", kv_cache_memory=per_token * 96, block_size=4, max_model_len=90)
    _, got = _run(engine, _mixed_requests(stop_token))
    assert got == expected
    assert engine.scheduler.num_preemptions_total > 0


def test_a_step_that_preempts_for_blocks_was_foreseen_and_a_full_pool_still_launches_ahead(tiny_checkpoint):
    """`Scheduler.may_run_out_of_blocks` bounds what the next schedule() takes: every step that
    preempts for blocks was predicted (so no pending token is preempted), and steps in a pool with
    fewer free blocks than the old bound (one per running request plus a whole budget of
    prefill) still launch ahead when their requests' growth fits."""
    folder, _ = tiny_checkpoint
    per_token = _engine(folder, "off").kv_bytes_per_token
    engine = _engine(folder, "on", kv_cache_memory=per_token * 96, block_size=4, max_model_len=90)
    scheduler = engine.scheduler
    schedule, record = scheduler.schedule, []

    def watched():
        predicted = scheduler.may_run_out_of_blocks()
        pending = any(r.has_pending_token for r in scheduler.running)
        free, running = engine.kv_manager.num_free_blocks, len(scheduler.running)
        out = schedule()
        record.append((predicted, bool(out.preempted), pending, free, running))
        return out

    scheduler.schedule = watched
    requests = [([1] + [(7 * i + j) % 200 + 2 for i in range(10)], SamplingParams(max_tokens=40, temperature=0.0,
                                                                                ignore_eos=True)) for j in range(6)]
    _run(engine, requests)
    assert scheduler.num_preemptions_total > 0
    assert all(predicted for predicted, preempted, _, _, _ in record if preempted)
    assert not any(pending for _, preempted, pending, _, _ in record if preempted)
    budget = engine.config.scheduler_config.max_num_batched_tokens
    old_bound = lambda running: running + budget // 4 + 1      # noqa: E731
    tight = [free for predicted, _, pending, free, running in record if pending and not predicted
             and free < old_bound(running)]
    assert tight, "no step ran ahead in a pool below the old bound"


def test_penalties_fall_back_to_sync_steps(tiny_checkpoint):
    """Requests whose sampling needs host-side history run synchronous steps; mixing them in
    changes nothing for the others."""
    folder, _ = tiny_checkpoint
    requests = [
        (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)),
        (PROMPTS[3], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)),
    ]
    _, expected = _run(_engine(folder, "off"), requests)
    _, got = _run(_engine(folder, "on"), requests)
    assert got == expected


def _logprob_outputs(engine: Engine, requests: list[tuple[list[int], SamplingParams]]):
    """{request id: (token ids, logprobs, cumulative logprob)} per sample; also whether any step of
    the run was launched ahead."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    finished, launched_ahead = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in out.outputs]
        launched_ahead |= engine._inflight is not None
    return finished, launched_ahead


def test_logprobs_launch_ahead_and_match_sync(tiny_checkpoint):
    """Sampled-token logprobs come from the step's own logits: steps that ask for them are launched
    ahead too, and every logprob, top-N entry and cumulative sum is the synchronous engine's."""
    folder, _ = tiny_checkpoint
    requests = [
        (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)),
        (PROMPTS[3], SamplingParams(max_tokens=9, temperature=0.7, seed=4, ignore_eos=True, logprobs=0)),
        (PROMPTS[1], SamplingParams(n=2, max_tokens=7, temperature=1.0, seed=9, ignore_eos=True, logprobs=1)),
    ]
    expected, sync_ahead = _logprob_outputs(_engine(folder, "off"), requests)
    got, async_ahead = _logprob_outputs(_engine(folder, "on"), requests)
    assert not sync_ahead and async_ahead
    assert got.keys() == expected.keys()
    for request_id, samples in expected.items():
        for (tokens, logprobs, cumulative), (got_tokens, got_logprobs, got_cumulative) in zip(samples, got[request_id]):
            assert got_tokens == tokens
            if logprobs is None:
                assert got_logprobs is None and got_cumulative is None
                continue
            assert [list(entry) for entry in got_logprobs] == [list(entry) for entry in logprobs]
            for entry, got_entry in zip(logprobs, got_logprobs):
                assert got_entry == pytest.approx(entry, abs=1e-5)
            assert got_cumulative == pytest.approx(sum(e[t] for e, t in zip(logprobs, tokens)), abs=1e-4)
            assert got_cumulative == pytest.approx(cumulative, abs=1e-4)
    # Greedy: the sampled id is the top one, so top 3 are 3 entries; logprobs=0: the sampled id alone.
    assert len(expected["r1"][0][1][0]) == 3 and len(expected["r2"][0][1][0]) == 1


def test_abort_with_a_pending_token_frees_everything(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    engine = _engine(folder, "on")
    requests = [(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)),
                (PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    engine.add_request("keep", {"prompt_token_ids": PROMPTS[1]}, requests[1][1])
    engine.add_request("drop", {"prompt_token_ids": PROMPTS[0]}, requests[0][1])
    for _ in range(4):
        engine.step()
    dropped = engine.scheduler.requests["drop"]
    assert dropped.output_token_ids[-1] == PENDING_TOKEN      # aborted while its token is in flight
    assert engine.abort("drop")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["keep"]
    assert PENDING_TOKEN not in dropped.output_token_ids[:-1]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks

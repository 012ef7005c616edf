"""Priority scheduling (--scheduling-policy priority): lower priority values go first, a waiting
request that outranks a running one and does not fit preempts it (recompute or swap), outputs do
not change, aging bounds how long a low-priority request is overtaken, and fcfs ignores priority."""

from __future__ import annotations

import random

import pytest

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import SamplingParams
from kvserve.engine.engine import Engine
from kvserve.sched.priority import aging_grace_s, by_priority, effective_priority
from kvserve.sched.scheduler import RequestRejected

BLOCK = 16
_RNG = random.Random(3)
LONG = [1] + [_RNG.randrange(3, 250) for _ in range(99)]
SHORT = [1] + [_RNG.randrange(3, 250) for _ in range(39)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("priority-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


def _engine(folder: str, **options) -> Engine:
    base = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20, block_size=BLOCK,
                max_model_len=512, async_scheduling="off", scheduling_policy="priority")
    return Engine.from_options(**{**base, **options})


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _alone(folder: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine = _engine(folder, scheduling_policy="fcfs")
    engine.add_request("x", {"prompt_token_ids": prompt}, _greedy(max_tokens))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return [o for o in outputs if o.finished][-1].outputs[0].token_ids


def _low_then_high(engine: Engine, low_steps: int = 5) -> tuple[list[str], dict[str, list[int]]]:
    """A long low-priority request runs; a short high-priority one arrives. (finish order, tokens)."""
    engine.add_request("low", {"prompt_token_ids": LONG}, _greedy(60), priority=5)
    order, tokens = [], {}
    for _ in range(low_steps):
        engine.step()
    engine.add_request("high", {"prompt_token_ids": SHORT}, _greedy(8), priority=0)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                order.append(output.request_id)
                tokens[output.request_id] = output.outputs[0].token_ids
    return order, tokens


@pytest.mark.parametrize("limit", ["slots", "blocks"])
def test_a_higher_priority_arrival_preempts_and_outputs_do_not_change(folder, limit):
    # slots: one request at a time. blocks: 11 blocks, the low request's whole context (10) and one
    # more; after 35 steps it holds 9, and the high one needs 3 (and one kept free).
    options = dict(max_num_seqs=1) if limit == "slots" else dict(kv_cache_memory=11 * 12288, max_num_seqs=4)
    engine = _engine(folder, **options)
    if limit == "blocks":
        assert engine.kv_manager.num_blocks == 11
    order, tokens = _low_then_high(engine, low_steps=5 if limit == "slots" else 35)
    assert order == ["high", "low"]
    assert engine.scheduler.num_preemptions_total >= 1
    assert tokens["high"] == _alone(folder, SHORT, 8)
    assert tokens["low"] == _alone(folder, LONG, 60)


def test_swap_preemption_for_priority_keeps_the_outputs(folder):
    engine = _engine(folder, max_num_seqs=1, preemption_mode="swap", kv_host_memory=4 << 20)
    order, tokens = _low_then_high(engine)
    assert order == ["high", "low"]
    assert engine.kv_manager.host_tier.swapped_out >= 1
    assert tokens["low"] == _alone(folder, LONG, 60)


def test_fcfs_ignores_priority(folder):
    order, _ = _low_then_high(_engine(folder, max_num_seqs=1, scheduling_policy="fcfs"))
    assert order == ["low", "high"]


def test_aging_lets_a_long_waiting_request_keep_its_place(folder):
    """With a level per 0.1 ms, the running request has aged past the newcomer's priority by the
    time it arrives: the newcomer waits."""
    engine = _engine(folder, max_num_seqs=1, scheduling_priority_aging=1e-4)
    order, _ = _low_then_high(engine)
    assert order == ["low", "high"] and engine.scheduler.num_preemptions_total == 0


def test_waiting_requests_are_admitted_by_priority_then_arrival(folder):
    engine = _engine(folder, max_num_seqs=1)
    for name, priority in [("c", 3), ("a", 1), ("b", 2), ("a2", 1)]:
        engine.add_request(name, {"prompt_token_ids": SHORT}, _greedy(2), priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["a", "a2", "b", "c"]


def test_effective_priority_ages_and_breaks_ties_by_arrival():
    class R:
        def __init__(self, priority, arrival_time, aging_grace_s=0.0):
            self.priority, self.arrival_time, self.aging_grace_s = priority, arrival_time, aging_grace_s
    old, new, tie = R(3, 0.0), R(1, 25.0), R(1, 20.0)
    assert effective_priority(old, 30.0, 10.0) == 0.0 and effective_priority(old, 30.0, 0) == 3.0
    assert by_priority([old, new, tie], 30.0, 0) == [tie, new, old]
    assert by_priority([old, new, tie], 30.0, 10.0) == [old, tie, new]
    # A request of a class with a 40 s TTFT target waits half of it before it ages.
    patient = R(3, 0.0, aging_grace_s=aging_grace_s(40.0))
    assert effective_priority(patient, 15.0, 10.0) == 3.0 and effective_priority(patient, 30.0, 10.0) == 2.0
    assert by_priority([patient, new, tie], 30.0, 10.0) == [tie, new, patient]
    assert aging_grace_s(None) == 0.0


def test_a_class_request_ages_after_half_its_ttft_target(folder, tmp_path):
    """The engine gives a request of a class its class's grace (half its ttft_p99); a request of no
    class ages from arrival."""
    import json
    qos = tmp_path / "qos.json"
    qos.write_text(json.dumps({"classes": {"bronze": {"priority": 2, "ttft_p99": 120.0}}}))
    engine = Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20,
                                 max_model_len=256, scheduling_policy="priority", qos_config=str(qos),
                                 async_scheduling="off")
    engine.add_request("b", {"prompt_token_ids": SHORT}, SamplingParams(max_tokens=2, qos_class="bronze"))
    engine.add_request("n", {"prompt_token_ids": SHORT}, SamplingParams(max_tokens=2))
    requests = engine.scheduler.requests
    assert requests["b"].aging_grace_s == 60.0 and requests["n"].aging_grace_s == 0.0


def test_a_priority_that_is_not_an_integer_is_rejected(folder):
    engine = _engine(folder)
    with pytest.raises(RequestRejected, match="priority"):
        engine.add_request("x", {"prompt_token_ids": SHORT}, _greedy(2), priority="high")

"""Request classes (--qos-config `classes`; kvserve/sched/qos_classes.py): a bad config is refused at
start naming the key; a request runs in the class it names or its tenant's default, at the class's
priority; a class its tenant may not use is refused as forbidden, an unknown one as a bad field; a
class that sheds rejects at arrival what cannot start within its target while a class above it is
not shed by the requests queued below it; while a class with work misses its measured p99, the
classes below it are not admitted."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import SamplingParams
from kvserve.engine.engine import Engine
from kvserve.sched.qos_classes import MIN_SAMPLES, ClassLatency, percentile
from kvserve.sched.qos_config import QoSClass, QoSClassForbidden, load_qos_config
from kvserve.sched.scheduler import RequestForbidden, RequestRejected
from kvserve.sched.slo import RequestOverloaded
from kvserve.sched.step_cost import StepShape

CLASSES = {"gold": {"priority": 0, "ttft_p99": 0.5, "on_miss": "shed"},
           "bronze": {"priority": 2, "ttft_p99": 1.0, "on_miss": "shed"}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qos-class-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


def _qos(tmp_path, body: dict) -> str:
    path = tmp_path / "qos.json"
    path.write_text(json.dumps(body))
    return str(path)


def _engine(folder: str, qos: str, **options) -> Engine:
    base = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=8 << 20, max_model_len=512,
                scheduling_policy="priority", qos_config=qos, async_scheduling="off")
    return Engine.from_options(**{**base, **options})


@pytest.mark.parametrize("body,field", [
    ({"classes": {"gold": {"priority": 0}}}, "classes.gold has no target"),
    ({"classes": {"gold": {"tpot_p99": 0.1, "on_miss": "shed"}}}, "classes.gold sheds"),
    ({"classes": {"gold": {"ttft_p99": -1}}}, "classes.gold.ttft_p99"),
    ({"classes": {"gold": {"ttft_p99": 1, "on_miss": "drop"}}}, "classes.gold.on_miss"),
    ({"classes": CLASSES, "default_class": "silver"}, "default_class names class 'silver'"),
    ({"classes": CLASSES, "tenants": {"a": {"default_class": "tin"}}}, "tenants.a.default_class"),
    ({"classes": CLASSES, "tenants": {"a": {"classes": ["gold", "tin"]}}}, "tenants.a.classes"),
    ({"classes": {"gold": {"ttft_p99": 1, "deadline": 2}}}, "deadline"),
])
def test_a_bad_class_config_is_refused_naming_the_key(tmp_path, body, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        load_qos_config(_qos(tmp_path, body))


def test_classes_need_the_priority_policy(folder, tmp_path):
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        _engine(folder, _qos(tmp_path, {"classes": CLASSES}), scheduling_policy="fcfs")


def test_a_request_runs_in_its_class_or_its_tenants_default_at_the_class_priority(folder, tmp_path):
    config = {"classes": CLASSES, "default_class": "bronze",
              "tenants": {"vip": {"default_class": "gold"}, "free": {"classes": ["bronze"]}}}
    qos = load_qos_config(_qos(tmp_path, config))
    assert qos.class_for("vip", None) == "gold"
    assert qos.class_for("someone", None) == "bronze" and qos.class_for(None, None) == "bronze"
    assert qos.class_for("free", "bronze") == "bronze"
    with pytest.raises(QoSClassForbidden, match="qos_class 'gold' is not open to tenant 'free'"):
        qos.class_for("free", "gold")
    with pytest.raises(ValueError, match="qos_class 'platinum' is not a class"):
        qos.class_for("vip", "platinum")

    engine = _engine(folder, _qos(tmp_path, config))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request("v", {"prompt_token_ids": [1, 2, 3]}, params, tenant="vip", priority=7)
    engine.add_request("f", {"prompt_token_ids": [1, 2, 3]}, params, tenant="free")
    requests = engine.scheduler.requests
    assert (requests["v"].qos_class, requests["v"].priority) == ("gold", 0)
    assert (requests["f"].qos_class, requests["f"].priority) == ("bronze", 2)
    with pytest.raises(RequestForbidden, match="qos_class 'gold'"):
        engine.add_request("x", {"prompt_token_ids": [1]}, SamplingParams(qos_class="gold"), tenant="free")
    with pytest.raises(RequestRejected, match="^qos_class 'tin'"):
        engine.add_request("y", {"prompt_token_ids": [1]}, SamplingParams(qos_class="tin"))
    while engine.has_unfinished_requests():
        engine.step()
    finished = {c.name: c.requests_finished for c in engine.make_stats().scheduler.classes}
    assert finished == {"bronze": 1, "gold": 1}


def test_a_class_that_sheds_rejects_what_cannot_start_in_time_and_not_the_class_above(folder, tmp_path):
    engine = _engine(folder, _qos(tmp_path, {"classes": CLASSES}), max_num_seqs=4, max_num_batched_tokens=64)
    assert engine.scheduler.slo.step_cost.coefficients is not None   # calibrated at start: classes need it
    params = SamplingParams(max_tokens=1, temperature=0.0, qos_class="bronze")
    prompt = [1] + [5] * 200
    admitted = 0
    with pytest.raises(RequestOverloaded, match="class 'bronze'"):
        for index in range(5000):                      # queued bronze work until a newcomer would be late
            engine.add_request(f"b{index}", {"prompt_token_ids": prompt}, params)
            admitted += 1
    assert admitted >= 4                               # the first ones fit in bronze's 1 s
    # Gold waits behind none of the queued bronze requests: it is admitted.
    engine.add_request("g", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, qos_class="gold"))
    stats = {c.name: c for c in engine.make_stats().scheduler.classes}
    assert stats["bronze"].requests_shed == 1 and stats["gold"].requests_shed == 0


def test_a_class_that_sheds_counts_on_preempting_the_classes_below_it(folder, tmp_path):
    """Every slot held by silver requests with hundreds of tokens to go: a gold request would wait
    for one of them to finish if it could not preempt, and the arrival check would shed it. Under
    the priority policy it takes a silver request's slot at once, so the check lets it in and its
    first token comes in the next step; a silver newcomer, which cannot preempt its own class, is
    shed."""
    classes = {"gold": {"priority": 0, "ttft_p99": 0.5, "on_miss": "shed"},
               "silver": {"priority": 1, "ttft_p99": 0.5, "on_miss": "shed"}}
    engine = _engine(folder, _qos(tmp_path, {"classes": classes}), max_num_seqs=2, max_num_batched_tokens=64)
    long = SamplingParams(max_tokens=450, temperature=0.0, ignore_eos=True, qos_class="silver")
    for index in range(2):
        engine.add_request(f"s{index}", {"prompt_token_ids": [1, 5, 6, 7]}, long)
    engine.step()
    scheduler = engine.scheduler
    assert len(scheduler.running) == 2
    assert scheduler.make_load(ahead_of_priority=0).preemptible == 2
    assert scheduler.make_load(ahead_of_priority=1).preemptible == 0
    # A step-cost model of a slower machine (as measured in test_slo.py): waiting for a slot (448
    # decode steps) takes longer than 0.45 s, a 4-token prompt much less.
    scheduler.slo.step_cost.calibrate([(StepShape(64, 1), 0.074), (StepShape(256, 1), 0.266), (StepShape(32, 32), 0.2)])
    cost = scheduler.slo.step_cost.coefficients
    assert 448 * cost.seconds(2, 2) > 0.5 and cost.seconds(4, 3) < 0.2
    scheduler.check_overload([1, 9, 9, 9], 4, qos_class="gold")              # not shed
    with pytest.raises(RequestOverloaded, match="class 'silver'"):
        scheduler.check_overload([1, 9, 9, 9], 4, qos_class="silver")
    engine.add_request("g", {"prompt_token_ids": [1, 9, 9, 9]}, SamplingParams(max_tokens=2, qos_class="gold"))
    engine.step()
    assert len(scheduler.requests["g"].output_token_ids) == 1
    assert engine.make_stats().scheduler.num_preemptions_total == 1


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_measured_p99_holds_lower_classes_and_the_window_forgets():
    clock = _Clock()
    latency = ClassLatency({"gold": QoSClass(priority=0, ttft_p99=0.5), "bronze": QoSClass(priority=2, ttft_p99=5)},
                           clock)
    for _ in range(MIN_SAMPLES - 1):
        latency.observe_finished("gold", 0.9, None)
    assert not latency.missing("gold")                # too few samples to judge
    latency.observe_finished("gold", 0.9, None)
    assert latency.missing("gold") and latency.held_below({"gold", "bronze"}) == 0
    assert latency.held_below({"bronze"}) is None     # gold has no work: it holds nobody
    clock.now = 31.0                                  # past the window: forgotten
    assert not latency.missing("gold")
    assert percentile([float(v) for v in range(1, 101)], 0.99) == 99.0


def test_lower_classes_wait_while_a_class_above_misses_its_p99(folder, tmp_path):
    engine = _engine(folder, _qos(tmp_path, {"classes": {"gold": {"priority": 0, "ttft_p99": 0.5},
                                                         "bronze": {"priority": 2, "ttft_p99": 60}}}))
    scheduler = engine.scheduler
    for _ in range(MIN_SAMPLES):
        scheduler.classes.observe_finished("gold", 2.0, None)      # gold has been late
    gold = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, qos_class="gold")
    bronze = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, qos_class="bronze")
    engine.add_request("g", {"prompt_token_ids": [1, 2, 3]}, gold)
    engine.add_request("b", {"prompt_token_ids": [1, 4, 5]}, bronze)
    engine.step()
    assert [r.request_id for r in scheduler.running] == ["g"]      # bronze held while gold runs late
    assert {c.name: c.holding_lower_classes for c in engine.make_stats().scheduler.classes}["gold"]
    while "g" in scheduler.requests:
        engine.step()
        if "g" in scheduler.requests:
            assert "b" not in [r.request_id for r in scheduler.running]
    scheduler.classes.clock = lambda: 1e9                           # gold's late samples are old now
    while engine.has_unfinished_requests():
        engine.step()
    stats = {c.name: c for c in engine.make_stats().scheduler.classes}
    assert stats["bronze"].requests_finished == 1


def _final_tokens(engine: Engine, seen: dict) -> None:
    for out in engine.step():
        if out.finished:
            seen[out.request_id] = list(out.outputs[0].token_ids)


def test_a_class_tpot_target_holds_the_batch_by_preempting_requests_without_a_promise(folder, tmp_path):
    # Gold's TPOT target is far under any step: its running limit is cut every few steps, and the
    # bronze requests (no TPOT target) are preempted down to it; gold itself never is.
    classes = {"gold": {"priority": 0, "tpot_p99": 1e-6}, "bronze": {"priority": 2, "ttft_p99": 60}}
    engine = _engine(folder, _qos(tmp_path, {"classes": classes}))
    scheduler = engine.scheduler
    bronze = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, qos_class="bronze")
    gold = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, qos_class="gold")
    prompts = {f"b{i}": [1, 7 + i, 9, 11 + i] for i in range(8)}
    prompts["g"] = [1, 2, 3, 4]
    for rid in [r for r in prompts if r != "g"]:
        engine.add_request(rid, {"prompt_token_ids": prompts[rid]}, bronze)
    seen: dict = {}
    for _ in range(3):
        _final_tokens(engine, seen)
    assert len(scheduler.running) == 8 and scheduler.slo.max_running == scheduler.config.max_num_seqs
    engine.add_request("g", {"prompt_token_ids": prompts["g"]}, gold)
    limits = []
    while "g" in scheduler.requests:
        limit = scheduler.slo.max_running          # what this step's scheduling holds
        _final_tokens(engine, seen)
        limits.append(scheduler.slo.max_running)
        assert "g" not in [r.request_id for r in scheduler.waiting]               # never preempted
        assert len(scheduler.running) + len(scheduler.loading) <= limit
    assert min(limits) == 1 and scheduler.num_preemptions_total > 0
    _final_tokens(engine, seen)
    assert engine.has_unfinished_requests()                                # bronze is back, unlimited:
    assert scheduler.slo.max_running == scheduler.config.max_num_seqs      # no promise with work, no limit
    while engine.has_unfinished_requests():
        _final_tokens(engine, seen)
    # Preempted and resumed, the bronze requests' greedy outputs equal a run without classes.
    plain = Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=8 << 20,
                                max_model_len=512, async_scheduling="off")
    expected: dict = {}
    for rid, prompt in prompts.items():
        plain.add_request(rid, {"prompt_token_ids": prompt}, replace(gold if rid == "g" else bronze, qos_class=None))
    while plain.has_unfinished_requests():
        _final_tokens(plain, expected)
    assert seen == expected


def test_a_held_class_aged_ahead_of_the_holding_one_does_not_stall_the_engine(folder, tmp_path):
    """Gold misses its p99 and holds the classes below it back, while bronze requests have waited
    long enough to age ahead of gold in the priority order, more of them than max_num_seqs. The
    candidates for admission are taken among the classes that may run before the cut to
    max_num_seqs: gold is admitted. (Cut first, the list held only bronze requests, nothing was
    admitted with nothing running, and the engine stopped with SchedulerStalled, failing every
    request: seen in qos_classes_bench at 2x overload.)"""
    engine = _engine(folder, _qos(tmp_path, {"classes": CLASSES}), max_num_seqs=2,
                     scheduling_priority_aging=0.001)
    bronze = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, qos_class="bronze")
    for index in range(4):
        engine.add_request(f"b{index}", {"prompt_token_ids": [1, 5, 6, 7]}, bronze)
    for _ in range(MIN_SAMPLES):
        engine.scheduler.classes.observe_finished("gold", ttft_s=10.0, tpot_s=0.01)
    import time
    time.sleep(0.02)                                  # the bronze requests age past gold's priority
    engine.add_request("g", {"prompt_token_ids": [1, 9, 9, 9]},
                       SamplingParams(max_tokens=2, temperature=0.0, qos_class="gold"))
    first = engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["g"]
    finished = {output.request_id for output in first if output.finished}
    while engine.has_unfinished_requests():
        finished |= {output.request_id for output in engine.step() if output.finished}
    assert finished == {"g", "b0", "b1", "b2", "b3"}

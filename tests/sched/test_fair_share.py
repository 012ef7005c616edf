"""Fair share between tenants (--scheduling-policy fair, VTC): while two tenants both have requests
waiting, the service each gets (prompt tokens + 2 x generated tokens) follows their --qos-config
weights within 10%, however many more requests one of them sent first; fcfs on the same trace does
not; an idle tenant banks no credit; a bad config is refused at start naming the key."""

from __future__ import annotations

import json
import random

import pytest

from conftest import TEST_DEVICE, build_tiny_checkpoint, outputs_alone
from kvserve import SamplingParams
from kvserve.engine.engine import Engine
from kvserve.sched.fair_share import VirtualTokenCounters
from kvserve.sched.qos_config import QoSConfig, TenantPolicy, load_qos_config

_RNG = random.Random(9)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("fair-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


def _qos(tmp_path, body: dict, suffix: str = ".json") -> str:
    path = tmp_path / f"qos{suffix}"
    path.write_text(json.dumps(body))
    return str(path)


def _served_while_both_wait(engine: Engine, heavy: int, light: int) -> dict:
    """Tenant a sends `heavy` requests, then tenant b `light`: a's come first in arrival order.
    Returns each tenant's service (VTC's weighted tokens) up to the step when one runs dry."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for tenant, count in (("a", heavy), ("b", light)):
        for index in range(count):
            prompt = [1] + [_RNG.randrange(3, 250) for _ in range(23)]
            engine.add_request(f"{tenant}{index}", {"prompt_token_ids": prompt}, params, tenant=tenant)
    served = {"a": 0.0, "b": 0.0}
    finished = {"a": 0, "b": 0}
    while all(finished[t] < n for t, n in (("a", heavy), ("b", light))):
        for output in engine.step():
            if output.finished:
                tenant = output.request_id[0]
                finished[tenant] += 1
                served[tenant] += 24 + 2 * 12
    return served


@pytest.mark.parametrize("weights", [(1, 1), (1, 3)])
def test_each_tenant_gets_its_weighted_share_while_both_wait(folder, tmp_path, weights):
    qos = _qos(tmp_path, {"tenants": {"a": {"weight": weights[0]}, "b": {"weight": weights[1]}}})
    engine = Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20,
                                 max_model_len=256, max_num_seqs=4, async_scheduling="off",
                                 scheduling_policy="fair", qos_config=qos, enable_prefix_caching=False)
    served = _served_while_both_wait(engine, heavy=120, light=40)
    share = served["b"] / (served["a"] + served["b"])
    expected = weights[1] / sum(weights)
    assert abs(share - expected) <= 0.1 * expected, (served, expected)


def test_fcfs_serves_the_heavy_tenant_first(folder):
    engine = Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20,
                                 max_model_len=256, max_num_seqs=4, async_scheduling="off",
                                 enable_prefix_caching=False)
    served = _served_while_both_wait(engine, heavy=40, light=10)
    assert served["b"] == 0


def test_an_idle_tenant_banks_no_credit():
    counters = VirtualTokenCounters(QoSConfig(tenants={"a": TenantPolicy(2.0)}))
    counters.charge("a", prompt_tokens=100, output_tokens=50)      # 200 weighted tokens / weight 2
    assert counters.counter("a") == 100 and counters.served["a"] == 200
    counters.activate("b", active={"a"})                           # b arrives while a is busy: lifted
    assert counters.counter("b") == 100
    counters.charge("b", output_tokens=5)
    counters.activate("a", active={"b"})                           # a comes back behind b: lifted
    assert counters.counter("a") == 110 and counters.counter("b") == 110
    counters.charge("c", prompt_tokens=500)
    counters.activate("c", active={"a", "b"})                      # ahead of them: never lowered
    assert counters.counter("c") == 500


def test_the_config_is_read_as_yaml_or_json_and_bad_keys_are_named(tmp_path):
    path = tmp_path / "qos.yaml"
    path.write_text("tenants:\n  alice: {weight: 3}\ndefault_weight: 0.5\n")
    config = load_qos_config(str(path))
    assert config.weight_of("alice") == 3 and config.weight_of("bob") == 0.5 and config.weight_of(None) == 0.5
    with pytest.raises(ValueError, match="weight must be a positive number"):
        load_qos_config(_qos(tmp_path, {"tenants": {"alice": {"weight": 0}}}))
    with pytest.raises(ValueError, match="wieght"):
        load_qos_config(_qos(tmp_path, {"tenants": {"alice": {"wieght": 2}}}))
    with pytest.raises(ValueError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        load_qos_config(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="cannot read"):
        load_qos_config(str(tmp_path / "missing.json"))


def _outputs_alone(options: dict, prompts: dict, params: SamplingParams) -> dict:
    return outputs_alone(Engine.from_options(**options), prompts, params)


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_tenant_that_filled_the_batch_is_preempted_for_a_newcomer(folder, tmp_path, policy):
    """Tenant a fills every slot with long requests while b is idle; then b sends one. Under fair
    share b's request runs within a few steps (a's newest request is preempted and resumes later),
    under fcfs it waits for a slot. Either way every output equals the request run alone."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = {f"a{i}": [1] + [3 + (17 * i + 5 * j) % 240 for j in range(19)] for i in range(3)}
    prompts["b0"] = [1] + [7 + (11 * j) % 230 for j in range(19)]
    options = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20, max_model_len=256,
                   async_scheduling="off", enable_prefix_caching=False)
    expected = _outputs_alone(options, prompts, params)
    engine = Engine.from_options(**options, max_num_seqs=3, scheduling_policy=policy,
                                 qos_config=_qos(tmp_path, {"tenants": {}}))
    for request_id in ("a0", "a1", "a2"):
        engine.add_request(request_id, {"prompt_token_ids": prompts[request_id]}, params, tenant="a")
    outputs, steps, first_token_step = {}, 0, None
    while engine.has_unfinished_requests():
        if steps == 5:
            engine.add_request("b0", {"prompt_token_ids": prompts["b0"]}, params, tenant="b")
        for output in engine.step():
            if output.request_id == "b0" and first_token_step is None and output.outputs[0].token_ids:
                first_token_step = steps
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        steps += 1
    assert outputs == expected
    preemptions = engine.make_stats().scheduler.num_preemptions_total
    if policy == "fair":
        # b's counter starts at a's (idle time banks no credit), so b runs once a is ahead by b's
        # prompt (20 tokens; a's three requests earn 6 a step): within 4 steps, not after a's 40.
        assert 5 <= first_token_step <= 10 and preemptions == 1
    else:
        assert first_token_step > 30 and preemptions == 0


@pytest.mark.parametrize("prefill_first", [True, False])
def test_a_newcomers_prompt_runs_ahead_of_the_batch(folder, tmp_path, prefill_first):
    """Tenant a has a batch decoding; b, behind it in service, sends a request. With
    fair_prefill_first b's prompt runs in a step of its own (none of a's decodes beside it); a's
    next request, a tenant ahead in service, is admitted beside the batch as usual. Without the
    option b's prompt shares a step with a's decodes. Outputs equal the requests run alone."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = {f"a{i}": [1] + [3 + (17 * i + 5 * j) % 240 for j in range(19)] for i in range(4)}
    prompts["b0"] = [1] + [7 + (11 * j) % 230 for j in range(19)]
    options = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20, max_model_len=256,
                   async_scheduling="off", enable_prefix_caching=False)
    expected = _outputs_alone(options, prompts, params)
    engine = Engine.from_options(**options, scheduling_policy="fair", fair_prefill_first=prefill_first,
                                 qos_config=_qos(tmp_path, {"tenants": {}}))
    steps_scheduled = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps_scheduled.append(sorted(item.request.request_id for item in out.scheduled))
        return out

    engine.scheduler.schedule = recording_schedule
    for request_id in ("a0", "a1", "a2"):
        engine.add_request(request_id, {"prompt_token_ids": prompts[request_id]}, params, tenant="a")
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 3:
            engine.add_request("b0", {"prompt_token_ids": prompts["b0"]}, params, tenant="b")
        if steps == 6:
            engine.add_request("a3", {"prompt_token_ids": prompts["a3"]}, params, tenant="a")
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        steps += 1
    assert outputs == expected
    admitting_b = next(step for step in steps_scheduled if "b0" in step)
    admitting_a3 = next(step for step in steps_scheduled if "a3" in step)
    assert steps_scheduled.index(admitting_b) == 3          # at once either way
    if prefill_first:
        assert admitting_b == ["b0"]
    else:
        assert admitting_b == ["a0", "a1", "a2", "b0"]
    assert admitting_a3 == ["a0", "a1", "a2", "a3", "b0"]   # a is ahead: beside the batch
    assert engine.make_stats().scheduler.num_preemptions_total == 0

"""benchmarks/kv/multiturn_bench.py: the multi-turn workload's properties (deterministic from its seed,
a working set of the asked multiple of the GPU KV, later turns extending earlier ones, returning
conversations interleaved), and the benchmark end to end at its tiniest size on the CPU: both configs
in the JSON, and a higher hit rate with the host tier than without it (a real check of the tier)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import time

import pytest

from conftest import build_tiny_checkpoint, requires_default_model

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "kv" / "multiturn_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("multiturn_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _workload(bench, seed=0, capacity=512, **overrides):
    options = dict(working_set_multiple=4.0, system_prompts=2, system_tokens=64, turns=3, user_tokens=32,
                   answer_tokens=8, vocab_size=1000, block_size=16)
    options.update(overrides)
    return bench.make_workload(seed, capacity, **options)


def _fake_answers(workload, conversation):
    """Stand-in answers (what the engine would generate): answer_tokens ids per turn."""
    return [[(7 * conversation + 3 * turn + i) % 900 + 50 for i in range(workload.answer_tokens)]
            for turn in range(workload.turns)]


def test_the_workload_is_deterministic_for_a_seed(bench):
    first, again, other = _workload(bench, 3), _workload(bench, 3), _workload(bench, 4)
    assert first == again
    assert first.system_prompts != other.system_prompts
    assert first.order != other.order or first.conversations != other.conversations
    random_order = _workload(bench, 3, order="random")
    assert random_order == _workload(bench, 3, order="random")
    open_loop = _workload(bench, 3, arrival_rate=2.0)
    assert open_loop.arrival_offsets == _workload(bench, 3, arrival_rate=2.0).arrival_offsets
    assert len(open_loop.arrival_offsets) == open_loop.num_requests


@pytest.mark.parametrize("capacity,multiple", [(512, 4.0), (2048, 4.0), (1024, 2.5), (4096, 8.0)])
def test_the_working_set_is_the_multiple_of_the_capacity(bench, capacity, multiple):
    workload = _workload(bench, 1, capacity, working_set_multiple=multiple)
    # Distinct KV counted directly: each system prompt in use once, every conversation's own tokens.
    systems = {c.system for c in workload.conversations}
    distinct = sum(len(workload.system_prompts[s]) for s in systems)
    distinct += sum(len(m) + workload.answer_tokens for c in workload.conversations for m in c.user_messages)
    assert workload.working_set_tokens == distinct
    # Within half of one conversation of the target: the count closest to it was chosen.
    largest = max(workload.conversation_tokens(c) for c in range(len(workload.conversations)))
    assert abs(distinct - multiple * capacity) <= largest / 2 + 1
    assert abs(workload.working_set_multiple - multiple) <= largest / 2 / capacity + 1e-9
    # A fixed count is honoured.
    assert len(_workload(bench, 1, capacity, conversations=5).conversations) == 5


def test_later_turns_extend_earlier_ones_and_share_system_prompts(bench):
    workload = _workload(bench, 2)
    assert len(workload.conversations) >= 2 * len(workload.system_prompts)
    for conv in range(len(workload.conversations)):
        answers = _fake_answers(workload, conv)
        system = workload.system_prompts[workload.conversations[conv].system]
        previous = None
        for turn in range(workload.turns):
            prompt = workload.prompt(conv, turn, answers[:turn])
            assert prompt[:len(system)] == list(system)
            assert len(prompt) == workload.prompt_length(conv, turn)
            if previous is not None:
                assert prompt[:len(previous) + len(answers[turn - 1])] == previous + answers[turn - 1]
                assert len(prompt) > len(previous) + len(answers[turn - 1])
            previous = prompt
    used = {c.system for c in workload.conversations}
    assert used == set(range(len(workload.system_prompts)))


@pytest.mark.parametrize("order", ["round-robin", "random"])
def test_conversations_return_after_the_others_have_passed(bench, order):
    workload = _workload(bench, 5, order=order)
    count = len(workload.conversations)
    assert sorted(workload.order) == [(c, t) for c in range(count) for t in range(workload.turns)]
    positions = {item: index for index, item in enumerate(workload.order)}
    gaps = []
    for conv in range(count):
        for turn in range(1, workload.turns):
            gap = positions[(conv, turn)] - positions[(conv, turn - 1)]
            assert gap > 0
            gaps.append(gap)
    if order == "round-robin":
        assert set(gaps) == {count}        # every other conversation passes in between
    else:
        assert sum(gaps) / len(gaps) >= count / 2
    # With an unbounded cache most prompt tokens repeat; the system prompts alone give far fewer.
    bounds = workload.hit_bounds()
    assert 0 < bounds["system_prompts_only"] < bounds["all"] < 1


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multiturn-llama")
    build_tiny_checkpoint("llama", folder)
    return str(folder)


@pytest.mark.parametrize("model", ["tiny-random-llama",
                                   pytest.param("default", marks=requires_default_model)])
def test_tiny_run_end_to_end_on_cpu(bench, tmp_path, model, request):
    """--tiny on the CPU, both configs: on a tiny random Llama (seconds) and on the default model
    (SmolLM2-135M, the documented smoke path: about 30 s on an idle 2-core VM)."""
    out = tmp_path / "multiturn.json"
    # One thread: on a machine shared with other jobs, two threads wait on each other for a core.
    argv = ["--tiny", "--device", "cpu", "--threads", "1", "--out", str(out)]
    if model != "default":
        argv += ["--model", request.getfixturevalue("tiny_llama"), "--step-timeline"]
    started = time.perf_counter()
    assert bench.main(argv) == 0
    elapsed = time.perf_counter() - started
    record = json.loads(out.read_text())
    assert set(record["configs"]) == {"no-host", "host"}
    workload = record["workload"]
    assert abs(workload["working_set_multiple"] - 4.0) < 0.5
    assert record["engine"]["gpu_kv_blocks"] * workload["block_size"] == workload["gpu_kv_capacity_tokens"]
    host, cold = record["configs"]["host"], record["configs"]["no-host"]
    for result in (host, cold):
        assert result["requests"] == workload["requests"]
        assert result["output_tokens"] == workload["output_tokens_total"]
        assert result["counters"]["generation_tokens"] == workload["output_tokens_total"]
        assert result["counters"]["query_tokens"] >= workload["prompt_tokens_total"]
        assert 0 < result["ttft_p50_s"] <= result["ttft_p99_s"]
        assert result["output_tokens_per_s"] > 0
    assert cold["counters"]["host"] is None and cold["host_hit_rate"] == 0 and cold["kv_host_memory"] == 0
    # The host tier holds the whole working set, and nothing else differs between the two configs.
    assert host["host_tier_blocks"] * workload["block_size"] >= workload["working_set_tokens"]
    # The tier works: returning conversations come back from the host, so more of each prompt hits;
    # without it the GPU cache (a quarter of the working set) keeps little beyond the system prompt.
    assert host["counters"]["host"]["blocks_written"] > 0 and host["counters"]["host"]["hit_tokens"] > 0
    assert host["hit_rate"] > cold["hit_rate"] + 0.1
    assert cold["hit_rate"] <= workload["hit_rate_bound"]["system_prompts_only"] + 0.1
    assert host["hit_rate"] <= workload["hit_rate_bound"]["all"] + 1e-6
    assert set(record["ratios"]) >= {"ttft_p50_no_host_over_host", "throughput_host_over_no_host"}
    if model != "default":
        # The step timeline saw every step, its copies and its loads; the phases' step count agrees.
        for result in (host, cold):
            timeline = result["step_timeline"]
            kinds = timeline["by_kind"]
            assert timeline["steps"] == sum(kind["steps"] for kind in kinds.values()) > 0
            assert kinds["decode_only"]["steps"] >= workload["output_tokens_total"] // workload["concurrency"] // 2
            assert all(row["gpu_ms"] > 0 for row in timeline["rows"])
            assert sum(row["prefill_tokens"] for row in timeline["rows"]) > 0
        copied = sum(row["copy_blocks"] for row in host["step_timeline"]["rows"])
        assert copied > 0 and sum(row["copy_blocks"] for row in cold["step_timeline"]["rows"]) == 0
    # Not asserted: a busy machine takes several times the idle figure.
    print(f"tiny multi-turn run ({model}): {elapsed:.1f}s")

"""The diagnostic passes of the benchmark scripts (their logic lives in kvserve.eval), and the
serving fairness benchmark end to end, run on tiny random models: they must account for every step
and every request, since their figures end up in benchmarks/results/."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import pathlib

import pytest

from conftest import TEST_DEVICE, requires_default_model

EVAL = pathlib.Path(__file__).resolve().parents[2] / "kvserve" / "eval"
SERVING = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "serving"


def test_offline_timeline_accounts_for_every_step_and_token(tiny_checkpoint):
    from kvserve.engine.engine import Engine
    from kvserve.eval import offline
    folder, _ = tiny_checkpoint
    engine = Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20,
                                 max_num_batched_tokens=64, max_num_seqs=8)
    args = argparse.Namespace(num_requests=12, seed=0, prompt_median=30, output_median=6, max_prompt=80,
                              max_output=12)
    timeline = offline.run_timeline(engine, args)
    prompts, outputs = offline.chat_like_lengths(12, 0, 30, 6, 80, 12)
    steps = timeline["steps_detail"]
    assert timeline["steps"] == len(steps) > 0
    # Every prompt token is computed in some step (no prefix hits: the prompts are random), and the
    # decode rows plus the steps that finish a prompt produce every output token.
    assert sum(step["prefill_tokens"] for step in steps) == int(prompts.sum())
    assert sum(step["tokens"] for step in steps) == int(prompts.sum()) + int(outputs.sum()) - len(outputs)
    assert timeline["prefill_steps"] + timeline["decode_steps"] + timeline["empty_steps"] == len(steps)
    assert sum(bucket["tokens"] for bucket in timeline["decode_by_rows_up_to"].values()) \
        == sum(step["rows"] for step in steps if not step["prefill_tokens"])
    assert all(step["tokens"] <= 64 and step["rows"] <= 8 and step["ms"] > 0 for step in steps)
    assert not engine.has_unfinished_requests() and engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_vllm_baseline_sends_the_prompts_kvserve_bench_sends():
    """The vLLM baseline (benchmarks/cpu/vllm_cpu_baseline.py) runs in vLLM's own environment and loads
    kvserve/eval/prompts.py and timing.py by their paths, without kvserve's package: they must import
    nothing from kvserve, and loaded that way give kvserve bench's token ids for the same point and repeat."""
    from kvserve.eval.bench import random_prompts
    for name in ("prompts", "timing"):
        tree = ast.parse((EVAL / f"{name}.py").read_text(encoding="utf-8"))
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [m for m in imported if m == "kvserve" or m.startswith("kvserve.")], name
    spec = importlib.util.spec_from_file_location("_standalone_prompts", EVAL / "prompts.py")
    standalone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standalone)
    for num, length, vocab, seed in [(1, 200, 49152, 1_000_004), (16, 200, 49152, 2_000_022), (3, 7, 50, 5)]:
        assert standalone.random_prompts(num, length, vocab, seed) == random_prompts(num, length, vocab, seed)


@pytest.mark.slow
@requires_default_model
def test_fairness_bench_runs_its_four_phases_on_one_trace(tmp_path):
    """benchmarks/serving/fairness_bench.py end to end on a tiny model, a two-second trace: B alone,
    then A and B under FCFS and under fair share (B's prompts in the batch's steps, then in steps of
    their own), each phase's requests all answered, and the
    service it reads from /v1/usage agreeing with the fair policy's own counter."""
    from loopback_server import build_tiny_chat_model
    folder = build_tiny_chat_model(tmp_path / "tiny", max_position_embeddings=1024)
    spec = importlib.util.spec_from_file_location("_fairness_bench", SERVING / "fairness_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "fairness.json"
    assert bench.main(["--duration", "2", "--capacity", "4", "--capacity-burst", "4", "--min-tokens", "2",
                       "--max-tokens", "4", "--json", str(out), "--", "--model", folder, "--max-model-len", "512",
                       "--kv-cache-memory", "8MiB"]) == 0
    report = json.loads(out.read_text())
    phases = report["phases"]
    assert list(phases) == ["b_alone", "fcfs", "fair_batch_steps", "fair"] and list(phases["b_alone"]["tenants"]) == ["b"]
    # The same trace in both shared phases: B's requests alone are B's requests among A's.
    assert phases["b_alone"]["tenants"]["b"]["requests"] == phases["fair"]["tenants"]["b"]["requests"] >= 1
    for phase in phases.values():
        for tenant in phase["tenants"].values():
            assert tenant["completed"] == tenant["requests"] and tenant["ttft_p99_s"] > 0
    for name in ("fair_batch_steps", "fair"):
        for tenant, row in phases[name]["service"].items():
            assert row["vtc_served"] == row["weighted_tokens"] > 0, tenant
    assert report["goal"]["b_ttft_p99_fair_over_alone"] > 0 and report["goal"]["b_ttft_p99_fair_batch_steps_over_alone"] > 0

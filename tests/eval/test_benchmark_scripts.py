"""The diagnostic passes of the benchmark scripts (their logic lives in kvserve.eval), run on a tiny
random model: they must account for every step and every request, since their figures end up in
benchmarks/results/."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import pathlib

from conftest import TEST_DEVICE

EVAL = pathlib.Path(__file__).resolve().parents[2] / "kvserve" / "eval"


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

"""Offline throughput on a chat-like workload, and the engine's own overhead at a large decode batch.

Part 1 (throughput): N requests (default 1,000) are queued at once and run to completion. Prompt and
output lengths are drawn from log-normal distributions shaped like chat traffic (ShareGPT-like:
medians about 220 prompt / 190 output tokens, long tails, clipped); outputs ignore EOS so every
request produces exactly its drawn length. Reports output tok/s, total tok/s and requests/s.

Part 2 (engine overhead): B requests (default 256) decode together; over a window of steady decode
steps, the GPU's busy time (sum of kernel durations, torch.profiler) is compared with the wall time of
`Engine.step`. Overhead = 1 - busy / wall: the share of a step in which the GPU waits for the host
(scheduling, metadata, sampling, detokenizing, Python).

python benchmarks/offline_throughput.py --model benchmarks/configs/r1-distill-llama-8b --load-format dummy \\
    --dtype bfloat16 --json benchmarks/results/gpu_h200_offline_llama8b.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from kvserve.eval.bench import environment_info, step_until_prompts_computed
from kvserve.config import add_engine_args, engine_options_from_args
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams


def chat_like_lengths(num_requests: int, seed: int, prompt_median: int, output_median: int,
                      max_prompt: int, max_output: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(prompt_median), 0.8, num_requests), 8, max_prompt).astype(int)
    outputs = np.clip(rng.lognormal(np.log(output_median), 0.7, num_requests), 8, max_output).astype(int)
    return prompts, outputs


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def run_throughput(engine: Engine, args) -> dict:
    prompt_lens, output_lens = chat_like_lengths(args.num_requests, args.seed, args.prompt_median,
                                                 args.output_median, args.max_prompt, args.max_output)
    rng = np.random.default_rng(args.seed + 1)
    vocab = engine.model.config.vocab_size
    # Warm-up: compile kernels for prefill/decode shapes outside the timed window.
    engine.add_request(None, {"prompt_token_ids": rng.integers(0, vocab, 64).tolist()},
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    _sync(engine)
    started = time.perf_counter()
    for prompt_len, output_len in zip(prompt_lens, output_lens):
        engine.add_request(None, {"prompt_token_ids": rng.integers(0, vocab, int(prompt_len)).tolist()},
                           SamplingParams(max_tokens=int(output_len), temperature=0.0, ignore_eos=True,
                                          output_kind="final_only"))
    steps = generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += len(output.outputs[0].token_ids)
        steps += 1
    _sync(engine)
    seconds = time.perf_counter() - started
    return {"num_requests": args.num_requests, "prompt_tokens": int(prompt_lens.sum()),
            "output_tokens": int(generated), "expected_output_tokens": int(output_lens.sum()),
            "prompt_len_median": float(np.median(prompt_lens)), "output_len_median": float(np.median(output_lens)),
            "seconds": round(seconds, 3), "steps": steps,
            "output_tokens_per_s": round(generated / seconds, 1),
            "total_tokens_per_s": round((generated + int(prompt_lens.sum())) / seconds, 1),
            "requests_per_s": round(args.num_requests / seconds, 2),
            "preemptions": engine.scheduler.num_preemptions_total}


def run_timeline(engine: Engine, args) -> dict:
    """The same workload again, the device synchronized after every step: each step's composition
    (prompt tokens, decode rows) and its own wall time. Slower than the throughput pass (no overlap of
    the host's work with the device's); it says where that pass's time goes, by kind of step."""
    prompt_lens, output_lens = chat_like_lengths(args.num_requests, args.seed, args.prompt_median,
                                                 args.output_median, args.max_prompt, args.max_output)
    rng = np.random.default_rng(args.seed + 3)     # other prompts than the throughput pass: no prefix hits
    vocab = engine.model.config.vocab_size
    for prompt_len, output_len in zip(prompt_lens, output_lens):
        engine.add_request(None, {"prompt_token_ids": rng.integers(0, vocab, int(prompt_len)).tolist()},
                           SamplingParams(max_tokens=int(output_len), temperature=0.0, ignore_eos=True,
                                          output_kind="final_only"))
    steps = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        prefill = sum(item.num_new_tokens for item in out.scheduled
                      if item.request.num_computed_tokens < item.request.num_prompt_tokens)
        steps.append({"tokens": out.num_batched_tokens, "prefill_tokens": prefill, "rows": len(out.scheduled),
                      "context_tokens": sum(item.request.num_computed_tokens for item in out.scheduled)})
        return out

    engine.scheduler.schedule = recording_schedule
    try:
        times = []
        _sync(engine)
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            _sync(engine)
            times.append(time.perf_counter() - started)
    finally:
        engine.scheduler.schedule = schedule
    # With overlapped scheduling a step's schedule() runs one step ahead of its execution; pair them
    # by order (the counts are what matter).
    steps = steps[:len(times)]
    for step, seconds in zip(steps, times):
        step["ms"] = round(seconds * 1e3, 3)
    with_prefill = [s for s in steps if s["prefill_tokens"]]
    decode = [s for s in steps if not s["prefill_tokens"] and s["rows"]]
    buckets = {}
    for step in decode:
        bucket = min(1024, 1 << max(0, (step["rows"] - 1).bit_length()))
        entry = buckets.setdefault(bucket, {"steps": 0, "seconds": 0.0, "tokens": 0})
        entry["steps"] += 1
        entry["seconds"] += step["ms"] / 1e3
        entry["tokens"] += step["rows"]
    return {"seconds": round(sum(times), 3), "steps": len(times),
            "prefill_steps": len(with_prefill),
            "prefill_step_seconds": round(sum(s["ms"] for s in with_prefill) / 1e3, 3),
            "prefill_step_tokens": sum(s["tokens"] for s in with_prefill),
            "decode_steps": len(decode), "decode_seconds": round(sum(s["ms"] for s in decode) / 1e3, 3),
            # Steps that scheduled nothing: with overlapped (async) scheduling on a GPU, the last
            # step only collects the previous step's tokens.
            "empty_steps": sum(1 for s in steps if not s["rows"]),
            "decode_by_rows_up_to": {str(k): {"steps": v["steps"], "seconds": round(v["seconds"], 3),
                                             "tokens": v["tokens"]} for k, v in sorted(buckets.items())},
            "steps_detail": steps}


def run_overhead(engine: Engine, args) -> dict:
    rng = np.random.default_rng(args.seed + 2)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=args.overhead_steps * 3 + 16, temperature=0.0, ignore_eos=True,
                            output_kind="final_only")
    for _ in range(args.overhead_batch):
        engine.add_request(None, {"prompt_token_ids": rng.integers(0, vocab, args.overhead_prompt).tolist()}, params)
    step_until_prompts_computed(engine)
    for _ in range(5):
        engine.step()
    _sync(engine)
    started = time.perf_counter()
    for _ in range(args.overhead_steps):
        engine.step()
    _sync(engine)
    step_ms = (time.perf_counter() - started) / args.overhead_steps * 1e3
    result = {"batch_size": args.overhead_batch, "prompt_len": args.overhead_prompt, "step_ms": round(step_ms, 3),
              "decode_tokens_per_s": round(args.overhead_batch / step_ms * 1e3, 1)}
    if engine.device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            wall_started = time.perf_counter()
            for _ in range(args.overhead_steps):
                engine.step()
            _sync(engine)
            wall = time.perf_counter() - wall_started
        busy_us = sum(event.device_time_total for event in prof.key_averages()
                      if event.device_type == torch.autograd.DeviceType.CUDA)
        # device_time_total of CUDA-type events is kernel time; under the profiler the wall grows a little,
        # so the overhead is measured against the profiled wall (conservative).
        busy = busy_us / 1e6
        result.update({"profiled_step_ms": round(wall / args.overhead_steps * 1e3, 3),
                       "gpu_busy_ms_per_step": round(busy / args.overhead_steps * 1e3, 3),
                       "overhead_fraction": round(max(0.0, 1.0 - busy / wall), 4)})
    while engine.has_unfinished_requests():
        for output in engine.step():
            pass
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--prompt-median", type=int, default=220)
    parser.add_argument("--output-median", type=int, default=190)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--overhead-batch", type=int, default=256)
    parser.add_argument("--overhead-prompt", type=int, default=512)
    parser.add_argument("--overhead-steps", type=int, default=20)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--timeline", action="store_true",
                        help="also rerun the workload with a device sync after every step and record each step")
    parser.add_argument("--json", default=None)
    add_engine_args(parser)
    args = parser.parse_args()
    options = engine_options_from_args(args)
    engine = Engine.from_options(**options)
    result = {"command": "python " + " ".join(sys.argv), "model": engine.source.path,
              "dtype": str(engine.dtype), "device": str(engine.device), "engine_options": options,
              "environment": environment_info(engine.device), "kv_capacity_tokens": engine.kv_manager.capacity_tokens}
    if engine.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(engine.device)
    if not args.skip_throughput:
        result["throughput"] = run_throughput(engine, args)
        print(json.dumps(result["throughput"]))
    if args.timeline:
        result["timeline"] = run_timeline(engine, args)
        print(json.dumps({k: v for k, v in result["timeline"].items() if k != "steps_detail"}))
    result["overhead"] = run_overhead(engine, args)
    print(json.dumps(result["overhead"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()

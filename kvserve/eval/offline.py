"""The offline-throughput workload and its passes (benchmarks/engine/offline_throughput.py runs them):
N chat-like requests queued at once and run to completion; the same workload again with each step
timed on its own (the timeline); and the engine's exposed host time at a large decode batch.

Prompt and output lengths are drawn from log-normal distributions shaped like chat traffic
(ShareGPT-like: medians about 220 prompt / 190 output tokens, long tails, clipped); outputs ignore
EOS so every request produces exactly its drawn length. The passes take the script's argparse
namespace (num_requests, seed, prompt_median, output_median, max_prompt, max_output, and for the
overhead pass overhead_batch, overhead_prompt, overhead_steps).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.eval.bench import step_until_prompts_computed
from kvserve.eval.timing import Stopwatch, now, synchronize
from kvserve.sampling_params import SamplingParams


def chat_like_lengths(num_requests: int, seed: int, prompt_median: int, output_median: int,
                      max_prompt: int, max_output: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(prompt_median), 0.8, num_requests), 8, max_prompt).astype(int)
    outputs = np.clip(rng.lognormal(np.log(output_median), 0.7, num_requests), 8, max_output).astype(int)
    return prompts, outputs


def run_throughput(engine, args) -> dict:
    prompt_lens, output_lens = chat_like_lengths(args.num_requests, args.seed, args.prompt_median,
                                                 args.output_median, args.max_prompt, args.max_output)
    rng = np.random.default_rng(args.seed + 1)
    vocab = engine.model.config.vocab_size
    # Warm-up: compile kernels for prefill/decode shapes outside the timed window.
    engine.add_request(None, {"prompt_token_ids": rng.integers(0, vocab, 64).tolist()},
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    with Stopwatch(engine.device) as watch:
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
    seconds = watch.seconds
    return {"num_requests": args.num_requests, "prompt_tokens": int(prompt_lens.sum()),
            "output_tokens": int(generated), "expected_output_tokens": int(output_lens.sum()),
            "prompt_len_median": float(np.median(prompt_lens)), "output_len_median": float(np.median(output_lens)),
            "seconds": round(seconds, 3), "steps": steps,
            "output_tokens_per_s": round(generated / seconds, 1),
            "total_tokens_per_s": round((generated + int(prompt_lens.sum())) / seconds, 1),
            "requests_per_s": round(args.num_requests / seconds, 2),
            "preemptions": engine.scheduler.num_preemptions_total}


def run_timeline(engine, args) -> dict:
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
        while engine.has_unfinished_requests():
            with Stopwatch(engine.device) as watch:
                engine.step()
            times.append(watch.seconds)
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


def run_overhead(engine, args) -> dict:
    """Engine overhead: B requests (overhead_batch) decode together; over a window of steady decode
    steps, the GPU's busy time (sum of kernel durations, torch.profiler) is compared with the wall
    time of `Engine.step`. Overhead = 1 - busy / wall: the share of a step in which the GPU waits for
    the host (scheduling, metadata, sampling, detokenizing, Python)."""
    rng = np.random.default_rng(args.seed + 2)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=args.overhead_steps * 3 + 16, temperature=0.0, ignore_eos=True,
                            output_kind="final_only")
    for _ in range(args.overhead_batch):
        engine.add_request(None, {"prompt_token_ids": rng.integers(0, vocab, args.overhead_prompt).tolist()}, params)
    step_until_prompts_computed(engine)
    for _ in range(5):
        engine.step()
    with Stopwatch(engine.device) as watch:
        for _ in range(args.overhead_steps):
            engine.step()
    step_ms = watch.ms / args.overhead_steps
    result = {"batch_size": args.overhead_batch, "prompt_len": args.overhead_prompt, "step_ms": round(step_ms, 3),
              "decode_tokens_per_s": round(args.overhead_batch / step_ms * 1e3, 1)}
    if engine.device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            wall_started = now()
            for _ in range(args.overhead_steps):
                engine.step()
            synchronize(engine.device)
            wall = now() - wall_started
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

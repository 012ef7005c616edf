"""Where an engine step's time goes: cProfile (host) and torch.profiler (device) over decode steps.

python benchmarks/engine/profile_step.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
    --dtype bfloat16 --batch-size 1 --kv-cache-memory 8GiB
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from kvserve.config import add_engine_args, engine_options_from_args
from kvserve.engine.engine import Engine
from kvserve.eval.bench import random_prompts, step_until_prompts_computed
from kvserve.eval.timing import Stopwatch, synchronize
from kvserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-kind", default="cumulative", choices=("cumulative", "final_only"),
                        help="final_only as `kvserve bench` (outputs only at the end), cumulative as the server")
    parser.add_argument("--trace", default=None, help="also write the torch.profiler window as a Chrome trace here")
    parser.add_argument("--phase", default="decode", choices=("decode", "prefill"))
    add_engine_args(parser)
    args = parser.parse_args()
    engine = Engine.from_options(**engine_options_from_args(args))
    if args.phase == "prefill":
        profile_prefill(engine, args)
        return
    params = SamplingParams(max_tokens=args.steps * 2 + 20, temperature=0.0, ignore_eos=True,
                            output_kind=args.output_kind)
    for prompt in random_prompts(args.batch_size, args.input_len, engine.model.config.vocab_size, 0):
        engine.add_request(None, {"prompt_token_ids": prompt}, params)
    step_until_prompts_computed(engine)
    for _ in range(5):
        engine.step()
    with Stopwatch(engine.device) as watch:
        for _ in range(args.steps):
            engine.step()
    print(f"decode step: {watch.ms / args.steps:.2f} ms at batch {args.batch_size}")

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    synchronize(engine.device)
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(25)
    print(stream.getvalue())

    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            engine.step()
        synchronize(engine.device)
    sort = "cuda_time_total" if engine.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25))
    if args.trace:
        prof.export_chrome_trace(args.trace)


def _prefill(engine: Engine, args, seed: int) -> int:
    """Adds a batch and steps until every prompt is computed; aborts the batch; returns the steps."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, output_kind="final_only")
    ids = [engine.add_request(None, {"prompt_token_ids": prompt}, params)
           for prompt in random_prompts(args.batch_size, args.input_len, engine.model.config.vocab_size, seed)]
    steps = 0
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
        steps += 1
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return steps


def profile_prefill(engine: Engine, args) -> None:
    _prefill(engine, args, seed=0)
    with Stopwatch(engine.device) as watch:
        steps = _prefill(engine, args, seed=1)
    seconds = watch.seconds
    tokens = args.batch_size * args.input_len
    print(f"prefill: {tokens} tokens in {steps} steps, {seconds:.3f} s, {tokens / seconds:.0f} tok/s")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _prefill(engine, args, seed=2)
        synchronize(engine.device)
    sort = "cuda_time_total" if engine.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=30))


if __name__ == "__main__":
    main()

"""What a host-tier hit costs and what it costs the others, in one engine:

1. TTFT of a long prefix (default 32k tokens) three ways: computed cold (what recompute pays), loaded
   from the host tier (after a second long prompt evicted it from the GPU cache), and hit in the GPU
   cache. Goal: from host >= 25x faster than cold.
2. Decode step time of a running batch while loads from the host stream in, against the same batch
   with no loads, in alternating phases: each load request's prefix was evicted to the host before,
   so it is copied in on the transfer stream while the batch keeps stepping. Only plain decode steps
   that start with a load in flight count as "with loads" (steps that also compute a landed load's
   last tokens are reported apart). Goal: no more than 5% slower.

    python benchmarks/kv/host_load_bench.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \\
        --dtype bfloat16 --kv-cache-memory 6GiB --kv-host-memory 24GiB --json out.json

On CPU (`--device cpu`, the default model, small sizes) it runs the same path as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from typing import Optional

import torch

from kvserve.config import add_engine_args, engine_options_from_args
from kvserve.eval.timing import now


def _run_alone(engine, prompt: list[int], params) -> float:
    """Seconds from adding the request to its first token, stepping the engine alone."""
    start = now()
    request_id = engine.add_request(None, {"prompt_token_ids": prompt}, params)
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.request_id == request_id and out.outputs[0].token_ids:
                ttft = now() - start
    return ttft


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="decoding requests in the running batch")
    parser.add_argument("--batch-context", type=int, default=512)
    parser.add_argument("--load-phases", type=int, default=3, help="phases with loads (alternating with quiet ones)")
    parser.add_argument("--loads-per-phase", type=int, default=4, help="prefixes loaded at once in a phase")
    parser.add_argument("--load-prefix-tokens", type=int, default=8192)
    parser.add_argument("--phase-steps", type=int, default=40)
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-ttft", action="store_true", help="only part 2 (decode steps under loads)")
    parser.add_argument("--profile", default=None,
                        help="part 2: a Chrome trace (torch.profiler) of the first quiet phase and the first with loads, to this file")
    parser.add_argument("--profile-ttft", action="store_true",
                        help="part 1: the host's time in one more from-host TTFT run, by function (cProfile), printed")
    add_engine_args(parser)
    args = parser.parse_args(argv)

    from kvserve import SamplingParams
    from kvserve.engine.engine import Engine
    rng = random.Random(0)
    vocab = (100, 30000)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(*vocab) for _ in range(length)]

    engine = Engine.from_options(**engine_options_from_args(args))
    if engine.host_store is None:
        raise SystemExit("needs the host KV tier (--kv-host-memory, prefix caching on)")
    capacity = engine.kv_manager.capacity_tokens
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    results: dict = {"gpu_kv_tokens": capacity, "host_kv_tokens": engine.host_store.num_blocks * engine.kv_manager.block_size,
                     "block_nbytes": engine.host_store.block_nbytes, "device": str(engine.device)}
    if 2 * args.prefix_tokens > capacity:
        print(f"note: two {args.prefix_tokens}-token prompts exceed the GPU cache ({capacity} tokens): fine, "
              f"the second evicts the first")

    # --- 1. TTFT cold / from host / GPU hit ------------------------------------------------------------
    if not args.skip_ttft:
        _ttft(engine, args, prompt, capacity, one, results)
    _decode_under_loads(engine, args, prompt, capacity, one, results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))},
                       "results": results}, fh, indent=2, default=str)
    return 0


def _ttft(engine, args, prompt, capacity, one, results) -> None:
    _run_alone(engine, prompt(args.prefix_tokens + 1), one)      # warm-up: kernels compiled, caches touched
    cold, host, gpu = [], [], []
    for _ in range(args.repeats):
        target = prompt(args.prefix_tokens + 1)
        cold.append(_run_alone(engine, target, one))
        _run_alone(engine, prompt(capacity - 64), one)       # evicts the target from the GPU: to the host
        hits_before = engine.make_stats().kv_cache.host.hit_tokens
        host.append(_run_alone(engine, target, one))
        loaded = engine.make_stats().kv_cache.host.hit_tokens - hits_before
        gpu.append(_run_alone(engine, target, one))
        dropped = {k: v for k, v in vars(engine.make_stats().kv_cache.transfers).items() if "dropped" in k}
        print(f"ttft cold {cold[-1] * 1e3:8.1f} ms  from host {host[-1] * 1e3:7.1f} ms ({loaded} tokens loaded)  "
              f"gpu hit {gpu[-1] * 1e3:6.1f} ms  write-backs dropped so far {dropped}")
    if args.profile_ttft:
        _profile_from_host(engine, args, prompt, capacity, one)
    transfers = engine.make_stats().kv_cache.transfers
    results["ttft"] = {"prefix_tokens": args.prefix_tokens, "cold_s": statistics.median(cold),
                       "from_host_s": statistics.median(host), "gpu_hit_s": statistics.median(gpu),
                       "cold_over_host": statistics.median(cold) / statistics.median(host),
                       "last_loaded_tokens": loaded,
                       "mean_load_s": transfers.load_seconds / max(transfers.loads, 1),
                       "loads_by_copy_engine": transfers.loads_by_copy_engine,
                       "prefix_bytes": loaded * engine.kv_bytes_per_token,
                       "runs": {"cold_s": cold, "from_host_s": host, "gpu_hit_s": gpu}}
    results["ttft"]["load_GB_per_s"] = results["ttft"]["prefix_bytes"] / results["ttft"]["mean_load_s"] / 1e9
    print(json.dumps(results["ttft"]))


def _profile_from_host(engine, args, prompt, capacity, one) -> None:
    """Where the host's time goes in a from-host TTFT: which Python work precedes the copy and
    follows it (a profile slows it, so this run is not one of the measured ones)."""
    import cProfile
    import pstats
    target = prompt(args.prefix_tokens + 1)
    _run_alone(engine, target, one)
    _run_alone(engine, prompt(capacity - 64), one)
    profile = cProfile.Profile()
    profile.enable()
    seconds = _run_alone(engine, target, one)
    profile.disable()
    print(f"profiled from-host TTFT: {seconds * 1e3:.1f} ms")
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)


def _decode_under_loads(engine, args, prompt, capacity, one, results) -> None:
    # --- 2. decode steps with and without loads in flight --------------------------------------------
    from kvserve import SamplingParams
    loads = [prompt(args.load_prefix_tokens + 1) for _ in range(args.load_phases * args.loads_per_phase)]
    for load in loads:                      # computed once: their blocks go to the host when evicted
        _run_alone(engine, load, one)
    _run_alone(engine, prompt(capacity - 64), one)     # evicts them all from the GPU cache
    # Long enough to outlast every phase; the batch is aborted at the end.
    decode = SamplingParams(max_tokens=(2 * args.load_phases + 1) * args.phase_steps + 8, temperature=0.0,
                            ignore_eos=True)
    batch_ids = [engine.add_request(None, {"prompt_token_ids": prompt(args.batch_context)}, decode)
                 for _ in range(args.batch)]
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    quiet, busy, mixed = [], [], []
    # The GPU's side of each step: an event on the main stream after each step's work is queued.
    # The time between two such events is the GPU's work on the later step plus any time it waited
    # for the host (a step that ran synchronously), so a slowdown here and not in the wall times
    # is the device's (SMs, HBM); one in the wall times only is the host's.
    timing_gpu = engine.device.type == "cuda"
    gpu_marks: list = []        # (event, bucket or None)

    loaded_before = engine.make_stats().kv_cache.host.hit_tokens
    profiler = None
    for phase in range(2 * args.load_phases + 1):
        with_loads = phase % 2 == 1
        if args.profile and phase == 0:             # a quiet phase and the first with loads, into a Chrome trace
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.start()
        if profiler is not None and phase == 2:
            profiler.stop()
            profiler.export_chrome_trace(args.profile)
            # Where the host's time in the steps with loads goes, by operator (the trace has the timeline).
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            profiler = None
        if with_loads:
            for _ in range(args.loads_per_phase):
                engine.add_request(None, {"prompt_token_ids": loads.pop()}, one)
        for _ in range(args.phase_steps):
            # With loads: a load is in flight, or one was just added (this step issues its copies).
            loading = bool(scheduler.loading) or bool(scheduler.waiting)
            # Requests still short of their prompt's end: a load request computes its last tokens in
            # the step after its blocks land, and (max_tokens 1) finishes in it.
            unfinished_prompts = {rid: r.num_computed_tokens for rid, r in scheduler.requests.items()
                                  if r.num_computed_tokens < r.num_prompt_tokens}
            started = now()
            with torch.profiler.record_function("step_with_loads" if with_loads and loading else "step"):
                engine.step()
            seconds = now() - started
            mark = torch.cuda.Event(enable_timing=True) if timing_gpu else None
            if mark is not None:
                mark.record()
            # A step that also computed a landed load's last tokens (a prefill chunk) is slower for
            # that work, not for the copies: only the batch's plain decode steps are compared.
            after = scheduler.requests
            # (A request admitted to load counts its blocks as computed once their copies are issued.)
            decode_only = all(rid in after and (after[rid].num_computed_tokens == before or rid in scheduler.loading)
                              for rid, before in unfinished_prompts.items())
            bucket = None
            if with_loads and loading:
                bucket = "busy" if decode_only else "mixed"
                (busy if decode_only else mixed).append(seconds)
            elif not with_loads and len(scheduler.running) == args.batch:
                bucket = "quiet"
                quiet.append(seconds)
            if mark is not None:
                gpu_marks.append((mark, bucket))
            if with_loads and not scheduler.loading and not scheduler.waiting and len(scheduler.running) == args.batch:
                break                       # every load landed and ran: back to the plain batch
        gpu_marks.append((None, None))          # a phase boundary: no interval spans it
    for request_id in batch_ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    loaded = engine.make_stats().kv_cache.host.hit_tokens - loaded_before
    gpu = {"quiet": [], "busy": []}
    if timing_gpu:
        torch.cuda.synchronize()
        for (previous, _), (mark, bucket) in zip(gpu_marks, gpu_marks[1:]):
            if previous is not None and mark is not None and bucket in gpu:
                gpu[bucket].append(previous.elapsed_time(mark) / 1e3)
    results["decode_under_loads"] = {
        "batch": args.batch, "load_prefix_tokens": args.load_prefix_tokens, "loaded_tokens": loaded,
        "steps_without_loads": len(quiet), "steps_with_loads": len(busy),
        "step_s_without_loads": statistics.median(quiet) if quiet else None,
        "step_s_with_loads": statistics.median(busy) if busy else None,
        "steps_with_loads_and_a_prefill": len(mixed),
        "step_s_with_loads_and_a_prefill": statistics.median(mixed) if mixed else None}
    if quiet and busy:
        results["decode_under_loads"]["slowdown"] = statistics.median(busy) / statistics.median(quiet) - 1
    if gpu["quiet"] and gpu["busy"]:
        results["decode_under_loads"].update({
            "gpu_step_s_without_loads": statistics.median(gpu["quiet"]),
            "gpu_step_s_with_loads": statistics.median(gpu["busy"]),
            "gpu_slowdown": statistics.median(gpu["busy"]) / statistics.median(gpu["quiet"]) - 1})
    print(json.dumps(results["decode_under_loads"]))

    results["transfers"] = engine.make_stats().kv_cache.transfers.__dict__


if __name__ == "__main__":
    sys.exit(main())

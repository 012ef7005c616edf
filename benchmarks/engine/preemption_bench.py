"""Overload through a small KV budget: recompute against swap preemption, in one process.

Every request is added at once, and the engine steps until all are done. A request runs
out of KV blocks while others decode, so requests are preempted. Under `recompute` a preempted
request computes its whole context again; under `swap` its blocks go to the host KV tier and come
back. Reported for each mode:
- wall time and output tokens/s;
- TTFT p50/p99 (from the burst's start);
- preemptions, and the host tier's swap counters;
- whether every request's tokens equal those of the first mode (greedy).

    python benchmarks/engine/preemption_bench.py --requests 64 --prompt-tokens 2048 --max-tokens 256 \\
        --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy --dtype bfloat16 \\
        --kv-cache-memory 2GiB --kv-host-memory 16GiB --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Optional

from kvserve.config import add_engine_args, engine_options_from_args
from kvserve.eval.timing import now, percentile


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--modes", default="recompute,swap")
    parser.add_argument("--json", default=None)
    add_engine_args(parser)
    args = parser.parse_args(argv)

    from kvserve import SamplingParams
    from kvserve.engine.engine import Engine
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    results, reference = {}, None
    for mode in args.modes.split(","):
        options = engine_options_from_args(args)
        options["preemption_mode"] = mode
        if mode == "recompute":
            options["kv_host_memory"] = 0
        engine = Engine.from_options(**options)
        start = now()
        ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
        first, tokens = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                    first[out.request_id] = now() - start
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
        seconds = now() - start
        ordered = [tokens[i] for i in ids]
        stats = engine.make_stats()
        host = stats.kv_cache.host
        ttft = sorted(first.values())
        results[mode] = {
            "seconds": seconds, "output_tokens_per_s": args.requests * args.max_tokens / seconds,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "preemptions": stats.scheduler.num_preemptions_total,
            "swapped_out": host.swapped_out if host else 0, "swapped_in": host.swapped_in if host else 0,
            "swap_failures": host.swap_failures if host else 0,
            "same_tokens_as_first_mode": reference is None or ordered == reference}
        reference = reference or ordered
        print(mode, json.dumps(results[mode]))
        del engine
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))},
                       "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

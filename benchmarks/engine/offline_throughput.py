"""Offline throughput on a chat-like workload, and the engine's own overhead at a large decode batch.

Part 1 (throughput): N requests (default 1,000) are queued at once and run to completion. Prompt and
output lengths are drawn from log-normal distributions shaped like chat traffic (ShareGPT-like:
medians about 220 prompt / 190 output tokens, long tails, clipped); outputs ignore EOS so every
request produces exactly its drawn length. Reports output tok/s, total tok/s and requests/s.

Part 2 (engine overhead): B requests (default 256) decode together; over a window of steady decode
steps, the GPU's busy time (sum of kernel durations, torch.profiler) is compared with the wall time of
`Engine.step`. Overhead = 1 - busy / wall: the share of a step in which the GPU waits for the host
(scheduling, metadata, sampling, detokenizing, Python).

The workload and the passes are kvserve.eval.offline's.

python benchmarks/engine/offline_throughput.py --model benchmarks/configs/r1-distill-llama-8b --load-format dummy \\
    --dtype bfloat16 --json benchmarks/results/engine/h200_offline_llama8b.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvserve.config import add_engine_args, engine_options_from_args
from kvserve.engine.engine import Engine
from kvserve.eval.bench import environment_info
from kvserve.eval.offline import run_overhead, run_throughput, run_timeline


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

"""A burst of requests against the offline engine with TTFT shedding: the engine-side half of load
shedding, on any device (no server, so it runs where fastapi is not installed, e.g. the GPU machine).

All requests are added at once through `Engine.add_request` (each timed: how long the decision
takes), then the engine steps until every admitted one is done. Reported: admitted / shed, the
decision time, the admitted requests' TTFT (arrival to first token, as the engine records it)
against the target, the step-cost model after calibration and at the end, and the step token cap.

    python benchmarks/engine/shed_burst.py --burst 200 --prompt-tokens 512 --max-tokens 64 --slo-ttft 2 \\
        --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy --dtype bfloat16 --kv-cache-memory 40GiB
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import time
from typing import Optional

from kvserve.config import add_engine_args, engine_options_from_args
from kvserve.eval.timing import now, percentile

def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    add_engine_args(parser)          # every engine flag, --slo-ttft / --slo-tpot among them
    args = parser.parse_args(argv)
    if args.slo_ttft is None:
        parser.error("--slo-ttft is needed: this measures shedding against it")

    from kvserve import SamplingParams
    from kvserve.engine.engine import Engine
    from kvserve.sched.slo import RequestOverloaded

    options = {**engine_options_from_args(args), "slo_shed": True}
    started = now()
    engine = Engine.from_options(**options)
    build_s = now() - started
    slo = engine.scheduler.slo
    calibrated = slo.step_cost.coefficients
    rng = random.Random(args.prompt_seed)
    vocab = min(engine.model.config.vocab_size, 30000)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    admitted, shed, decision_s = [], 0, []
    for i in range(args.burst):
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
        before = now()
        try:
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
            admitted.append(str(i))
        except RequestOverloaded:
            shed += 1
        decision_s.append(now() - before)
    budget_at_start = engine.scheduler.step_token_budget()
    ttft: dict[str, float] = {}
    queue_shed = 0
    started = now()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                metrics = output.metrics
                if output.outputs[0].finish_reason == "rejected":
                    queue_shed += 1
                elif metrics.first_token_time is not None:
                    ttft[output.request_id] = metrics.first_token_time - metrics.arrival_time
    run_s = now() - started
    final = slo.step_cost.coefficients
    ttfts = list(ttft.values())

    def rounded(value: Optional[float], digits: int = 4) -> Optional[float]:
        return None if value is None else round(value, digits)

    result = {
        "num_requests": args.burst, "num_admitted": len(admitted), "num_shed_at_arrival": shed,
        "num_shed_in_queue": queue_shed,
        "decision_s_p50": rounded(percentile(decision_s, 50), 6), "decision_s_p99": rounded(percentile(decision_s, 99), 6),
        "admitted_ttft_p50_s": rounded(percentile(ttfts, 50)), "admitted_ttft_p99_s": rounded(percentile(ttfts, 99)),
        "admitted_ttft_max_s": rounded(max(ttfts) if ttfts else None),
        "admitted_within_target": (round(sum(t <= args.slo_ttft for t in ttfts) / len(ttfts), 3) if ttfts else None),
        "step_token_budget_at_start": budget_at_start, "run_s": round(run_s, 3), "engine_build_s": round(build_s, 1),
        "step_cost_calibrated": vars(calibrated) if calibrated else None,
        "step_cost_final": vars(final) if final else None,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        import torch
        report = {"benchmark": "shed_burst", "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                  "device": torch.cuda.get_device_name(0) if engine.device.type == "cuda" else platform.processor(),
                  "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "workload": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                               "burst": args.burst, "slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot},
                  "engine_options": {k: v for k, v in options.items() if v is not None},
                  "result": result}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

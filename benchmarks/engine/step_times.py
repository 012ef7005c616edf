"""Where a `kvserve bench`-style run's time goes, step by step: prefill vs decode steps.

Runs one batch (same prompts as `kvserve bench`) and synchronizes the device after every engine step,
so each step's wall time is its own (overlapped scheduling still queues ahead, but each step's
time is closed off by the sync). Prints totals for steps with prompt tokens and pure decode steps,
and decode step time percentiles by batch size.

    python benchmarks/engine/step_times.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
        --dtype bfloat16 --batch-size 128 --input-len 512 --output-len 256 --kv-cache-memory 40GiB
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

from kvserve.eval.bench import random_prompts
from kvserve.eval.timing import Stopwatch
from kvserve.config import add_engine_args, engine_options_from_args
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--json", default=None)
    add_engine_args(parser)
    args = parser.parse_args()
    engine = Engine.from_options(**engine_options_from_args(args))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    vocab = engine.model.config.vocab_size

    def run(batch: int, seed: int) -> list[dict]:
        for prompt in random_prompts(batch, args.input_len, vocab, seed):
            engine.add_request(None, {"prompt_token_ids": prompt}, params)
        steps = []
        while engine.has_unfinished_requests():
            waiting = engine.num_waiting
            prefill_tokens = sum(r.num_prompt_tokens - r.num_computed_tokens for r in engine.scheduler.running
                                 if r.num_computed_tokens < r.num_prompt_tokens)
            with Stopwatch(engine.device) as watch:
                engine.step()
            steps.append({"seconds": watch.seconds, "running": engine.num_running,
                          "prefill_pending": prefill_tokens + waiting})
        return steps

    # Warm-up (compile, CUDA graphs) on other prompts: the same ones would be prefix-cache hits.
    run(min(args.batch_size, 8), seed=1)
    before = _compiled_kernels()
    with Stopwatch(engine.device) as watch:
        steps = run(args.batch_size, seed=0)
    total = watch.seconds
    compiled = sorted(_compiled_kernels() - before)
    if compiled:   # Triton kernels compiled during the measured run (a fresh TRITON_CACHE_DIR shows them all)
        print("compiled during the run:", ", ".join(name for _, name in compiled))
        _print_variants({name for _, name in compiled})
    prefill = [s for s in steps if s["prefill_pending"] > 0]
    decode = [s for s in steps if s["prefill_pending"] == 0]
    summary = {
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "total_s": round(total, 4), "output_tok_per_s": round(args.batch_size * args.output_len / total, 1),
        "steps": len(steps), "prefill_steps": len(prefill),
        "prefill_steps_s": round(sum(s["seconds"] for s in prefill), 4),
        "decode_steps": len(decode), "decode_steps_s": round(sum(s["seconds"] for s in decode), 4),
        "decode_step_ms_median": round(1e3 * statistics.median(s["seconds"] for s in decode), 3) if decode else None,
        "decode_step_ms_at_full_batch": round(1e3 * statistics.median(
            s["seconds"] for s in decode if s["running"] == args.batch_size), 3)
        if any(s["running"] == args.batch_size for s in decode) else None,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "steps": steps}, f)


def _compiled_kernels() -> set[tuple[str, str]]:
    """(cache entry, kernel name) of every Triton kernel in the on-disk cache."""
    cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    found = set()
    for path in glob.glob(os.path.join(cache, "*", "*.json")):
        if os.path.basename(path).startswith("__grp__"):
            continue
        try:
            with open(path) as f:
                found.add((os.path.dirname(path), json.load(f).get("name", "?")))
        except (OSError, ValueError):
            pass
    return found


def _print_variants(names: set[str]) -> None:
    """The specialization keys each named kernel was compiled for: what differs between them is
    what made it compile again."""
    import importlib
    import pkgutil

    import kvserve.kernels.triton as package
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for attr, kernel in vars(module).items():
            if attr in names and hasattr(kernel, "device_caches"):
                for device, caches in kernel.device_caches.items():
                    for key in caches[0]:
                        print(f"{attr} variant on device {device}: {key}")


if __name__ == "__main__":
    main()

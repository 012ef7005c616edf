"""Decode step time and KV held per request after a press, at several keep ratios and KV formats
(random-weight shapes: the H200 run of the Qwen-7B shape).

    python benchmarks/kv/press_speed_bench.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \\
        --dtype bfloat16 --context 32768 --batch 16 --ratios 1,0.5,0.25 --formats bf16,int4 --json OUT.json

For each KV format, one engine; for each keep ratio, `batch` requests of `context` random tokens
arrive together, are prefilled (the press runs at each one's prompt end: streaming_llm, which
needs no observation window, so the prefill steps are the same in every case), then decode
`--decode-steps` tokens. Recorded: the median time of the steps that are all decodes of the whole
batch, the KV blocks each request holds after its press, and the requests that would fit the
cache at that size. A batch with a short context (`--short-context`) gives the step time without
long-context attention, so the attention part of a step is (step - short step) and its share at a
ratio can be set against the ratio itself (the proportional gain).

`--press-mode tier` runs the tiering mode instead (engine/kv_tiering.py): the same share of blocks
stays on the GPU, the rest go to a host tier of `--kv-host-memory`, and every `--kv-tier-interval`
decode steps the blocks are ranked and recalled; its step time, set against the drop mode's at
the same ratio, is the cost of the rankings and recalls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from kvserve import SamplingParams  # noqa: E402
from kvserve.config import _parse_bytes  # noqa: E402
from kvserve.engine.engine import Engine  # noqa: E402

FORMATS = {"bf16": {"kv_cache_dtype": "auto"},
           "int4": {"kv_cache_dtype": "int4", "kv_quant_key_layout": "channel"},
           "int8": {"kv_cache_dtype": "int8"}, "fp8": {"kv_cache_dtype": "fp8"}}


def run_batch(engine: Engine, context: int, batch: int, ratio: float, decode_steps: int, seed: int,
              mode: str = "drop") -> dict:
    rng = random.Random(seed)
    press = {} if ratio >= 1 else dict(kv_press="streaming_llm", kv_keep_ratio=ratio, kv_press_mode=mode)
    # The first requests decode while the later ones prefill (a token per step): enough tokens that
    # all of them are still decoding for `decode_steps` steps once the last prefill is done.
    prefill_steps = -(-context * batch // engine.config.scheduler_config.max_num_batched_tokens) + batch
    params = SamplingParams(max_tokens=decode_steps + prefill_steps, temperature=0.0, ignore_eos=True, **press)
    top = min(30000, engine.model.config.vocab_size)
    ids = [engine.add_request(None, {"prompt_token_ids": [rng.randrange(10, top) for _ in range(context)]}, params)
           for _ in range(batch)]
    decode_times, blocks_held = [], None
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        all_decoding = len(running) == batch and all(r.num_tokens - r.num_computed_tokens <= 1 for r in running)
        if all_decoding and blocks_held is None:
            blocks_held = statistics.mean(len(engine.kv_manager.block_table(r.request_id)) for r in running)
        step_started = time.perf_counter()
        engine.step()
        if all_decoding:
            decode_times.append(time.perf_counter() - step_started)
    total = time.perf_counter() - started
    steady = decode_times[len(decode_times) // 4:]        # past the first (graph warm-up, pending reads)
    blocks_held = blocks_held or 0
    return {"ratio": ratio, "requests": len(ids), "decode_steps_timed": len(steady),
            "decode_step_ms": round(statistics.median(steady) * 1e3, 3) if steady else None,
            "blocks_per_request": blocks_held,
            "requests_that_fit": int(engine.kv_manager.num_blocks // blocks_held) if blocks_held else None,
            "seconds": round(total, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--short-context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ratios", default="1,0.5,0.25")
    parser.add_argument("--formats", default="bf16,int4")
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--kv-cache-memory", default="48GiB")
    parser.add_argument("--press-mode", default="drop", choices=("drop", "tier"))
    parser.add_argument("--kv-host-memory", default="40GiB", help="tier mode: the host tier's size")
    parser.add_argument("--kv-tier-interval", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    results = {"command": "python " + " ".join(sys.argv), "context": args.context, "batch": args.batch,
               "press_mode": args.press_mode, "formats": {}}
    tier = args.press_mode == "tier"
    # The host tier needs prefix caching; random prompts share nothing, so it changes nothing else.
    tier_options = dict(kv_host_memory=_parse_bytes(args.kv_host_memory), kv_tier_interval=args.kv_tier_interval,
                        enable_prefix_caching=True) if tier else dict(enable_prefix_caching=False)
    if tier:
        results["kv_tier_interval"] = args.kv_tier_interval
    for name in args.formats.split(","):
        engine = Engine.from_options(model=args.model, load_format=args.load_format, dtype=args.dtype,
                                     kv_cache_memory=_parse_bytes(args.kv_cache_memory),
                                     max_model_len=args.context + 4096, max_num_seqs=args.batch,
                                     kv_press_min_tokens=64, **tier_options, **FORMATS[name])
        rows = [run_batch(engine, args.short_context, args.batch, 1.0, args.decode_steps, seed=1)]
        rows[0]["short"] = True
        for index, ratio in enumerate(ratios):
            rows.append(run_batch(engine, args.context, args.batch, ratio, args.decode_steps, seed=10 + index,
                                  mode=args.press_mode))
        short = rows[0]["decode_step_ms"]
        full = next((r["decode_step_ms"] for r in rows[1:] if r["ratio"] >= 1), None)
        for row in rows[1:]:
            if full and short is not None and row["decode_step_ms"] is not None and full > short:
                # The long-context part of the step, as a share of the full-KV one, next to the ratio.
                row["attention_share"] = round((row["decode_step_ms"] - short) / (full - short), 3)
                if row["ratio"] < 1:
                    row["proportional_gain_achieved"] = round((1 - row["attention_share"]) / (1 - row["ratio"]), 3)
        results["formats"][name] = {"kv_bytes_per_token": engine.kv_bytes_per_token, "rows": rows,
                                    "num_blocks": engine.kv_manager.num_blocks}
        print(f"== {name} ({engine.kv_bytes_per_token} bytes/token)")
        for row in rows:
            print(json.dumps(row))
        del engine
        import gc
        import torch
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefix-cache benchmark: hit rate per eviction policy next to Belady's MIN, and TTFT with and
without prefix caching through the real engine.

Part 1 (hit rates, no model): synthetic traces (kvserve.eval.prefix_traces), generated from a seed,
are replayed request by request (kvserve.eval.prefix_sim) through the engine's own `KVCacheManager` +
`PrefixCache` (the code the scheduler calls: `find_cached_prefix`, `allocate_slots`,
`cache_full_blocks`, `free`) on a simulated clock, for each eviction policy and several cache sizes.
The offline optimum replays the same trace with the same block accounting (a request holds all its
blocks while it runs; only full computed blocks are cached; the last prompt token is always
recomputed) but evicts the cached block whose next use is farthest in the future (Belady's MIN; ties
deeper-first). A second offline yardstick is lru that
also knows which blocks no later request looks up and evicts those first: what knowing *that* a
conversation has ended is worth, without knowing *when* the others come back (below MIN, but not
above every online policy: it has no notion of frequency). A third is lru that knows from the whole
trace which blocks are shared prefixes (at or above a branch of the chain tree: system prompts) and
evicts them last: what learning the shared prefixes perfectly, with recency for the rest, is worth.

Traces: system, chat, chat-sessions, mixed (kvserve/eval/prefix_traces.py says what each is).

Part 2 (TTFT): a multi-turn chat through `Engine` on the default model (CPU), with and without
prefix caching: the same conversations (a shared system prompt, turns interleaved across
conversations, one request at a time so TTFT is the prompt's own prefill).

    python benchmarks/kv/prefix_bench.py                    # both parts, JSON to benchmarks/results/kv/
    python benchmarks/kv/prefix_bench.py --quick --no-ttft  # a smaller hit-rate run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from kvserve.eval.prefix_sim import (FIXED_POLICIES, POLICIES, shared_prefix_blocks, simulate_belady,  # noqa: E402
                                     simulate_dead_first_lru, simulate_policy, simulate_shared_last_lru)
from kvserve.eval.prefix_traces import BLOCK_SIZE, TRACES, unique_blocks  # noqa: E402
from kvserve.eval.timing import Stopwatch, now  # noqa: E402
from kvserve.kvcache.manager import blocks_for_tokens  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "kv")


# --------------------------------------------------------------------------------------------------
# TTFT through the engine
# --------------------------------------------------------------------------------------------------

def ttft_run(enable_prefix_caching: bool, conversations: int, turns: int, max_tokens: int,
             system_words: int, seed: int) -> dict:
    from kvserve.sampling_params import SamplingParams
    from kvserve.llm import LLM
    llm = LLM(None, dtype="float32", device="cpu", kv_cache_memory=256 << 20,
              enable_prefix_caching=enable_prefix_caching)
    engine = llm.engine
    rng = random.Random(seed)
    words = ("cache memory block token prefix request model engine policy tenant latency batch "
             "kernel tensor layer attention query key value eviction pin system prompt turn").split()
    system = "You are a careful assistant for a storage company. " + " ".join(
        rng.choice(words) for _ in range(system_words))
    histories = [[{"role": "system", "content": system}] for _ in range(conversations)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    records = []
    for turn in range(turns):
        for conv, history in enumerate(histories):
            question = f"Question {turn} from user {conv}: explain " + " ".join(rng.choice(words) for _ in range(12))
            history.append({"role": "user", "content": question})
            prompt_ids = llm.apply_chat_template(history)
            start = now()
            request_id = engine.add_request(None, {"prompt_token_ids": prompt_ids}, params)
            first = None
            final = None
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    if first is None and output.outputs[0].token_ids:
                        first = now() - start
                    if output.finished:
                        final = output
            history.append({"role": "assistant", "content": final.outputs[0].text})
            records.append({"turn": turn, "conversation": conv, "prompt_tokens": len(prompt_ids),
                            "ttft_s": round(first, 4), "output_tokens": final.outputs[0].token_ids})
    stats = engine.prefix.stats
    return {"enable_prefix_caching": enable_prefix_caching, "records": records,
            "hit_rate": round(stats.hit_rate, 4) if enable_prefix_caching else 0.0,
            "mean_ttft_s": round(statistics.mean(r["ttft_s"] for r in records), 4),
            "median_ttft_s": round(statistics.median(r["ttft_s"] for r in records), 4),
            "mean_ttft_after_first_turn_s": round(statistics.mean(r["ttft_s"] for r in records if r["turn"] > 0), 4),
            "prompt_tokens_total": sum(r["prompt_tokens"] for r in records)}


# --------------------------------------------------------------------------------------------------

def _machine() -> dict:
    import torch
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count()}


def run_hit_rates(args) -> dict:
    results = {"command": "python benchmarks/kv/prefix_bench.py " + " ".join(sys.argv[1:]), "block_size": BLOCK_SIZE,
               "machine": _machine(), "lru_k": args.lru_k, "heat_half_life_s": args.half_life, "traces": {}}
    for name in args.traces:
        trace = TRACES[name](args.seed, args.requests)
        working_set = unique_blocks(trace)
        largest = max(blocks_for_tokens(len(r.prompt) + len(r.output), BLOCK_SIZE) for r in trace)
        sizes = sorted({max(largest + 1, int(working_set * f)) for f in args.fractions})
        shared = shared_prefix_blocks(trace) if args.oracle_bounds else set()
        entry = {"num_requests": len(trace), "prompt_tokens": sum(len(r.prompt) for r in trace),
                 "unique_blocks": working_set, "duration_s": round(trace[-1].time - trace[0].time, 1), "sizes": []}
        for size in sizes:
            row = {"capacity_blocks": size, "capacity_tokens": size * BLOCK_SIZE,
                   "fraction_of_unique_blocks": round(size / working_set, 3), "hit_rate": {}}
            for policy in POLICIES:
                with Stopwatch() as watch:
                    sim = simulate_policy(trace, size, policy, args.lru_k, args.half_life)
                row["hit_rate"][policy] = round(sim["hit_rate"], 4)
                row.setdefault("evictions", {})[policy] = sim["evictions"]
                row.setdefault("replay_s", {})[policy] = round(watch.seconds, 2)
                if "adaptive" in sim:
                    row["adaptive"] = sim["adaptive"]
            row["hit_rate"]["belady"] = round(simulate_belady(trace, size), 4)
            if args.oracle_bounds:
                row["oracle_bounds"] = {
                    "lru_evicting_never_reused_first": round(simulate_dead_first_lru(trace, size), 4),
                    "lru_keeping_shared_prefixes": round(simulate_shared_last_lru(trace, size, shared), 4)}
            fixed = {p: row["hit_rate"][p] for p in FIXED_POLICIES}
            best = max(fixed, key=fixed.get)
            row["best_fixed"] = best
            row["adaptive_minus_best_fixed"] = round(row["hit_rate"]["adaptive"] - fixed[best], 4)
            row["belady_minus_adaptive"] = round(row["hit_rate"]["belady"] - row["hit_rate"]["adaptive"], 4)
            entry["sizes"].append(row)
            print(f"{name:7s} {size:6d} blocks ({row['fraction_of_unique_blocks']:.2f} of working set): "
                  + "  ".join(f"{p} {v:.3f}" for p, v in {**row["hit_rate"], **row.get("oracle_bounds", {})}.items()),
                  flush=True)
        results["traces"][name] = entry
    gaps = [row["adaptive_minus_best_fixed"] for t in results["traces"].values() for row in t["sizes"]]
    to_min = [row["belady_minus_adaptive"] for t in results["traces"].values() for row in t["sizes"]]
    results["summary"] = {"worst_adaptive_minus_best_fixed": min(gaps), "worst_belady_minus_adaptive": max(to_min),
                          "goal_within_5_points_of_best_fixed": min(gaps) >= -0.05,
                          "goal_within_15_points_of_belady": max(to_min) <= 0.15}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default="system,chat,chat-sessions,mixed")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--fractions", default="0.01,0.02,0.05,0.1",
                        help="cache sizes as fractions of the trace's distinct blocks")
    parser.add_argument("--lru-k", type=int, default=2)
    parser.add_argument("--half-life", type=float, default=120.0, help="lru-k heat half-life, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1000 requests per trace")
    parser.add_argument("--ttft", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure TTFT through the engine on the default model")
    parser.add_argument("--hit-rates", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--oracle-bounds", action=argparse.BooleanOptionalAction, default=True,
                        help="also replay the offline yardsticks for the gap to Belady: lru knowing which blocks "
                             "are never looked up again, and lru keeping the trace's shared prefixes")
    parser.add_argument("--ttft-conversations", type=int, default=3)
    parser.add_argument("--ttft-turns", type=int, default=4)
    parser.add_argument("--out-dir", default=os.path.normpath(RESULTS))
    args = parser.parse_args()
    args.traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    args.fractions = [float(f) for f in args.fractions.split(",")]
    if args.quick:
        args.requests = 1000
    os.makedirs(args.out_dir, exist_ok=True)
    if args.hit_rates:
        results = run_hit_rates(args)
        path = os.path.join(args.out_dir, "prefix_hit_rates.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps(results["summary"]), "->", path)
    if args.ttft:
        runs = [ttft_run(flag, args.ttft_conversations, args.ttft_turns, 24, 300, args.seed) for flag in (False, True)]
        same = [r["output_tokens"] for r in runs[0]["records"]] == [r["output_tokens"] for r in runs[1]["records"]]
        ttft = {"command": "python benchmarks/kv/prefix_bench.py " + " ".join(sys.argv[1:]), "machine": _machine(),
                "model": "SmolLM2-135M-Instruct (default, GGUF Q4_1 dequantized to fp32), CPU",
                "conversations": args.ttft_conversations, "turns": args.ttft_turns,
                "outputs_identical_with_and_without_caching": same, "runs": runs,
                "speedup_mean_ttft": round(runs[0]["mean_ttft_s"] / runs[1]["mean_ttft_s"], 2)}
        path = os.path.join(args.out_dir, "prefix_ttft.json")
        with open(path, "w") as f:
            json.dump(ttft, f, indent=1)
        print(f"TTFT mean {runs[0]['mean_ttft_s']:.3f}s without, {runs[1]['mean_ttft_s']:.3f}s with prefix caching "
              f"(hit rate {runs[1]['hit_rate']:.3f}); outputs identical: {same} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

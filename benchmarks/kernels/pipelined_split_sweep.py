"""The pipelined quantized decode kernel's time per launch shape and split count, on CUDA.

At the reference point (32k context, batch 32, bf16 queries, blocks of 16 at random), for each shape,
KV format and launch (TILE:STAGES[:MAX_REGISTERS]) it times the kernel (CUDA-graph replay median,
kvserve.eval.timing.graph_do_bench_ms) at every split count given, and prints the count the engine would
pick (`auto`). Shapes: qwen7b and llama8b (kv_quant_attention_bench.SHAPES), and the same attention
with one KV head and the batch scaled up to the same bytes per layer (qwen7b-1kv: 7 query heads,
batch 128; llama8b-1kv: 4 query heads, batch 256), which tells whether the cache's layout (a
position's KV heads side by side) costs bandwidth at int4's 64-byte rows.

    python benchmarks/kernels/pipelined_split_sweep.py --formats int4-g32,int4-g64 --launches 64:2,32:2 \\
        --splits 2,4,8,12,16 --json benchmarks/results/kernels/h200_kv_quant_pipelined_splits.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import benchmarks.kernels.kv_quant_attention_bench as quant_bench  # noqa: E402
from kvserve.eval.timing import graph_do_bench_ms  # noqa: E402

# name: (shape in kv_quant_attention_bench.SHAPES terms, batch multiplier)
ONE_KV_HEAD_SHAPES = {"qwen7b-1kv": ((7, 1, 128), 4), "llama8b-1kv": ((4, 1, 128), 8)}


def sweep(shapes: list[str], formats: list[str], launches: list[str], splits: list[int], context_len: int,
          batch: int) -> list[dict]:
    from kvserve.kernels.triton.decode_attention import decode_workspace
    from kvserve.kernels.triton.decode_attention_quant import decode_num_splits_quant, paged_decode_attention_quant
    from kvserve.kernels.triton.decode_attention_quant_pipelined import pipelined_config
    for name, (shape, _) in ONE_KV_HEAD_SHAPES.items():
        quant_bench.SHAPES.setdefault(name, shape)
    points = []
    for shape in shapes:
        shape_batch = batch * ONE_KV_HEAD_SHAPES.get(shape, (None, 1))[1]
        for fmt in formats:
            spec, k_cache, v_cache, tables, lens, rows, query, _ = quant_bench.make_caches(
                shape, fmt, context_len, shape_batch, 16)
            seq_rows = rows if spec.needs_rows else None
            out = torch.empty_like(query)
            scale = query.shape[2] ** -0.5
            for launch in launches:
                values = [int(v) for v in launch.split(":")]
                config = replace(pipelined_config(k_cache.shape[2], fmt.startswith("int4")), tile=values[0],
                                 num_stages=values[1], max_registers=values[2] if len(values) > 2 else None)
                options = dict(config=config, implementation="pipelined")
                paged_decode_attention_quant(query, k_cache, v_cache, tables, lens, scale, seq_rows, out=out,
                                             **options)             # compile, measure occupancy
                auto = decode_num_splits_quant(query, k_cache, v_cache, tables, **options)
                times = {}
                for num_splits in splits:
                    workspace = decode_workspace(shape_batch, query.shape[1], query.shape[2], num_splits + 1,
                                                 query.device)

                    def attend():
                        paged_decode_attention_quant(query, k_cache, v_cache, tables, lens, scale, seq_rows, out=out,
                                                     num_splits=num_splits, workspace=workspace, **options)
                    times[num_splits] = graph_do_bench_ms(attend)
                    points.append(dict(shape=shape, batch=shape_batch, format=fmt, launch=launch,
                                       num_splits=num_splits, auto_splits=auto, attention_ms=times[num_splits]))
                print(f"{shape:12} {fmt:18} {launch:10} auto={auto:<3} "
                      + " ".join(f"{n}:{ms:.4f}" for n, ms in times.items()), flush=True)
            del k_cache, v_cache
            torch.cuda.empty_cache()
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen7b,llama8b",
                        help=f"of {sorted(quant_bench.SHAPES)} and {sorted(ONE_KV_HEAD_SHAPES)}")
    parser.add_argument("--formats", default="int4-g32,int4-g64,int4-g128")
    parser.add_argument("--launches", default="64:2", help="TILE:STAGES[:MAX_REGISTERS], comma-separated")
    parser.add_argument("--splits", default="1,2,4,8,12,16")
    parser.add_argument("--context-len", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    points = sweep(args.shapes.split(","), args.formats.split(","), args.launches.split(","),
                   [int(s) for s in args.splits.split(",")], args.context_len, args.batch)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(["python", *sys.argv]),
                                               "gpu": torch.cuda.get_device_name(), "points": points}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

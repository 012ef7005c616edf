"""Prefill chunks over a cached quantized context on CUDA: the fused Triton kernel against the torch reference.

For each KV format and chunk length Q, `--batch` chunks, each the last Q tokens of a `--context-len`
context (R1-Distill-Qwen-7B attention: 28 query heads, 4 KV heads, head_dim 128, bf16 queries, blocks of
16 at random), one layer's attention for all of them:
- fused: kernels/triton/prefill_attention_quant.py, every chunk in one launch (the codes dequantized in
  registers, once per query tile);
- reference: kernels/quant_reference.paged_prefill_attention per chunk (gather the context, dequantize
  it once, SDPA), what the engine ran before.
Times are triton.testing.do_bench medians (no CUDA graph: prefill steps are not captured).

    python benchmarks/prefill_quant_bench.py --json benchmarks/results/kv_quant_prefill_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kv_quant_attention_bench as quant_bench  # noqa: E402


def one_point(fmt: str, context_len: int, query_len: int, batch: int, block_size: int) -> dict:
    import triton.testing
    from kvserve.attention.metadata import PrefillChunk
    from kvserve.kernels import quant_reference
    from kvserve.kernels.triton.prefill_attention_quant import paged_prefill_attention_quant, plan_quant_prefill
    spec, k_cache, v_cache, tables, _, rows, _, generator = quant_bench.make_caches(
        "qwen7b", fmt, context_len, batch, block_size)
    heads, _, head_dim = quant_bench.SHAPES["qwen7b"]
    positions = torch.arange(context_len, device=tables.device)
    chunks = []
    for b in range(batch):
        slots = tables[b, positions // block_size].to(torch.int64) * block_size + positions % block_size
        chunks.append(PrefillChunk(b * query_len, query_len, context_len, slots, int(rows[b])))
    query = torch.randn(batch * query_len, heads, head_dim, dtype=torch.bfloat16, device=tables.device,
                        generator=generator)
    out = torch.empty_like(query)
    scale = head_dim ** -0.5
    plan = plan_quant_prefill(chunks, torch.empty(0, dtype=torch.long, device=tables.device))

    def fused():
        paged_prefill_attention_quant(query, k_cache, v_cache, plan, scale, out=out)

    def reference():
        for chunk in chunks:
            span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[span] = quant_reference.paged_prefill_attention(query[span], k_cache, v_cache, chunk.context_slots,
                                                                scale, chunk.kv_row)
    point = {"format": fmt, "context_len": context_len, "query_len": query_len, "batch": batch}
    for name, fn in (("fused_ms", fused), ("reference_ms", reference)):
        fn()
        point[name] = round(triton.testing.do_bench(fn, warmup=5, rep=50), 4)
    point["fused_speedup"] = round(point["reference_ms"] / point["fused_ms"], 2)
    return point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int8,int4-g32-w128-s4")
    parser.add_argument("--query-lens", default="16,64,256,1024,2048")
    parser.add_argument("--context-len", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    points = []
    for fmt in args.formats.split(","):
        for query_len in (int(q) for q in args.query_lens.split(",")):
            points.append(one_point(fmt, args.context_len, query_len, args.batch, args.block_size))
            print(points[-1], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(["python", *sys.argv]),
                                               "gpu": torch.cuda.get_device_name(), "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

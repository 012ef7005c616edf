"""Decode attention time vs split count, per KV format, at the reference point (32k context, batch 32,
R1-Distill-Qwen-7B attention: 28 query heads, 4 KV heads, head_dim 128) on CUDA.

Asks whether the quantized kernel is bound by bytes: if it were, int4 (about a quarter of bf16's
bytes) would take about a quarter of the time. Each format runs at every split count in SPLITS with
its default launch (and, for the quantized kernel, two launch variants: 128-token tiles with 8 warps,
and 3 pipeline stages); times are CUDA-graph replay medians (kvserve.eval.timing.graph_do_bench_ms).

    python benchmarks/kernels/kv_quant_split_sweep.py --json benchmarks/results/kernels/h200_kv_quant_split_sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.kv_quant_attention_bench import make_caches  # noqa: E402
from kvserve.eval.timing import graph_do_bench_ms  # noqa: E402
from kvserve.kernels.triton.decode_attention import decode_workspace, paged_decode_attention  # noqa: E402
from kvserve.kernels.triton.decode_attention_quant import paged_decode_attention_quant  # noqa: E402
from kvserve.kernels.triton.decode_attention_quant_config import default_quant_decode_config  # noqa: E402

SPLITS = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
FORMATS = ("bf16", "int8", "fp8_e4m3", "int4-g32")


def launch_variants(head_dim: int, dtype: torch.dtype) -> dict:
    base = default_quant_decode_config(head_dim, dtype)
    return {"default": None, "tile128-warps8": replace(base, tile=128, num_warps=8, num_stages=2),
            "stages3": replace(base, num_stages=3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-len", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    points = []
    for fmt in FORMATS:
        spec, k_cache, v_cache, tables, context_lens, rows, query, _ = make_caches(
            "qwen7b", fmt, args.context_len, args.batch, 16)
        batch, heads, head_dim = query.shape
        out = torch.empty_like(query)
        quantized = not isinstance(k_cache, torch.Tensor)
        seq_rows = rows if spec.needs_rows else None
        variants = launch_variants(head_dim, query.dtype) if quantized else {"default": None}
        for name, config in variants.items():
            for splits in SPLITS:
                workspace = decode_workspace(batch, heads, head_dim, splits, query.device)
                options = {} if config is None else {"config": config}
                if quantized:
                    def attend():
                        paged_decode_attention_quant(query, k_cache, v_cache, tables, context_lens, head_dim ** -0.5,
                                                     seq_rows, out=out, num_splits=splits, workspace=workspace,
                                                     **options)
                else:
                    def attend():
                        paged_decode_attention(query, k_cache, v_cache, tables, context_lens, head_dim ** -0.5,
                                               out=out, num_splits=splits, workspace=workspace)
                attend()
                point = {"format": fmt, "launch": name, "splits": splits, "ms": round(graph_do_bench_ms(attend), 4)}
                print(point, flush=True)
                points.append(point)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "context_len": args.context_len, "batch": args.batch,
            "points": points}, indent=1))


if __name__ == "__main__":
    main()

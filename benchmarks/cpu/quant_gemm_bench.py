"""GGUF-block GEMM (kvserve/kernels/cpu/quant_gemm.c) against the bf16-panel GEMM (llama_forward.c) on
the default model's linear shapes, side by side in one run: the ratio is bf16 time over quantized time.

    python benchmarks/cpu/quant_gemm_bench.py --json benchmarks/results/cpu/quant_gemm.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels.cpu.weight_formats import GGUF_BLOCK_FORMATS

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def _seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    import gguf
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k)
        panels = cpu_kernels.pack_weight(weight, bf16=True)
        for fmt_name in ("Q4_1", "Q8_0"):
            fmt = GGUF_BLOCK_FORMATS[fmt_name]
            blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[fmt_name])
            packed = cpu_kernels.repack_blocks(torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8)),
                                               fmt.code, k)
            for batch in map(int, args.batches.split(",")):
                x = torch.randn(batch, k)
                repeats = 10 if n > 10000 else 50
                quantized = _seconds(lambda: cpu_kernels.quant_linear(x, packed, fmt.code, n), repeats)
                bf16 = _seconds(lambda: cpu_kernels.linear(x, panels, n), repeats)
                row = {"shape": shape_name, "n": n, "k": k, "format": fmt_name, "batch": batch,
                       "quantized_us": round(quantized * 1e6, 1), "bf16_us": round(bf16 * 1e6, 1),
                       "speedup_vs_bf16": round(bf16 / quantized, 2), "weight_bytes": packed.numel(),
                       "bf16_weight_bytes": panels.nbytes}
                rows.append(row)
                print(json.dumps(row))
    result = {"isa": cpu_kernels.quant_isa(), "threads": torch.get_num_threads(),
              "fma_gflops": cpu_kernels.fma_gflops(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

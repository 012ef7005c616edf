"""CPU linear: torch's F.linear, the oneDNN-packed fp32 weight (kvserve/model/cpu_linear.py, the torch path)
and the native panel-packed GEMM in fp32 and bf16 weights (kvserve/kernels/cpu, the native path).

Shapes are the default model's (SmolLM2-135M: hidden 576, intermediate 1536, vocab 49152). Several weight copies
per shape so they stream from memory, as in a real forward, instead of sitting in the L3 cache.

python benchmarks/cpu/cpu_linear_bench.py --json benchmarks/results/cpu/linear_bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from kvserve.eval.timing import median_of
from kvserve.kernels import cpu as cpu_kernels
from kvserve.model.cpu_linear import PackedLinear, can_pack

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def _median_ms(fn, repeats: int) -> float:
    return median_of(fn, repeats, warmup=1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not can_pack(torch.float32, torch.device("cpu")):
        sys.exit("oneDNN weight packing is not available in this torch build")
    points = []
    for name, (out_features, in_features) in SHAPES.items():
        copies = 1 if out_features > 10_000 else 8
        weights = [torch.randn(out_features, in_features) for _ in range(copies)]
        packed = [PackedLinear(w, None) for w in weights]
        native = {dtype: [cpu_kernels.pack_weight(w, dtype == "bf16") for w in weights] for dtype in ("fp32", "bf16")} \
            if cpu_kernels.available() else {}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features)
            plain = _median_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights], args.repeats) / copies
            onednn = _median_ms(lambda: [p(x) for p in packed], args.repeats) / copies
            flops = 2 * rows * out_features * in_features
            point = {"layer": name, "rows": rows, "torch_linear_ms": round(plain, 4), "onednn_packed_ms": round(onednn, 4),
                     "speedup": round(plain / onednn, 2), "onednn_gflops": round(flops / onednn / 1e6, 1)}
            line = f"{name:8s} rows {rows:4d}: torch {plain:8.3f} ms  oneDNN {onednn:8.3f} ms"
            for dtype, panels in native.items():
                ms = _median_ms(lambda: [cpu_kernels.linear(x, p, out_features) for p in panels], args.repeats) / copies
                point[f"native_{dtype}_ms"] = round(ms, 4)
                point[f"native_{dtype}_gflops"] = round(flops / ms / 1e6, 1)
                line += f"  native {dtype} {ms:8.3f} ms"
            points.append(point)
            print(line)
    if args.json:
        result = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "platform": platform.platform(), "processor": platform.processor(), "points": points}
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()

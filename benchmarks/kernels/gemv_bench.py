"""Decode-time linear layers at small batch on CUDA: cuBLAS (F.linear) against kvserve's Triton skinny
GEMM (kvserve/kernels/triton/gemv.py), as weight bytes streamed per second.

Two measurements, both CUDA-graph replays timed with CUDA events:
- per shape: the R1-Distill-Qwen-7B linear layers (qkv, o, gate_up, down, lm_head), each called over
  enough distinct weight copies (>= 512 MB) that nothing is served from L2; with --sweep, a grid of
  launch configurations for the Triton kernel;
- the chain: all 28 layers' four GEMMs plus the lm_head on one set of weights (14.1 GB), as a decode
  step at batch 1 streams them; its cuBLAS column is the "GEMM-chain ceiling" of
  docs/gpu_performance.md#decode-throughput-by-batch-size (where the figures are).

    python benchmarks/kernels/gemv_bench.py --json benchmarks/results/kernels/h200_gemv.json [--sweep qkv,o,down]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvserve.eval.timing import capture_graph, cuda_event_mean_ms, cuda_event_times_ms, median  # noqa: E402
from kvserve.kernels.triton import gemv as gemv_mod  # noqa: E402

# R1-Distill-Qwen-7B: hidden 3584, intermediate 18944, 28 query / 4 KV heads of 128, vocab 152064.
QWEN7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
LM_HEAD = (152064, 3584)
LAYERS = 28


def time_graph(fn, replays: int = 20) -> float:
    """Milliseconds per call of fn() captured in a CUDA graph (median over replays, CUDA events)."""
    graph = capture_graph(fn)                    # compiles / warms up outside the capture
    return median(cuda_event_times_ms(graph.replay, replays, warmup=1))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (as docs/gpu_performance.md states the copy bandwidth)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_event_mean_ms(lambda: dst.copy_(src), 10, warmup=3)
    del src, dst
    return 2 * (2 << 30) / (ms * 1e-3)


def per_shape(rows_list: list[int], sweep: list[str]) -> list[dict]:
    results = []
    for name, (n, k) in list(QWEN7B.items()) + [("lm_head", LM_HEAD)]:
        weight_bytes = n * k * 2
        copies = max(1, -(-(512 << 20) // weight_bytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = F.linear(x.float(), weights[0].float())
            got = gemv_mod.gemv(x, weights[0]).float()
            error = (got - expected).abs().max().item()
            cublas_ms = time_graph(lambda: [F.linear(x, w) for w in weights]) / copies
            default = gemv_mod.default_config(n, k)
            triton_ms = time_graph(lambda: [gemv_mod.gemv(x, w, config=default) for w in weights]) / copies
            point = {"layer": name, "n": n, "k": k, "rows": m, "weight_bytes": weight_bytes,
                     "cublas_ms": cublas_ms, "cublas_tb_s": weight_bytes / cublas_ms / 1e9,
                     "triton_ms": triton_ms, "triton_tb_s": weight_bytes / triton_ms / 1e9,
                     "triton_config": asdict(default), "max_abs_err_vs_fp32": error}
            if name in sweep and m == 1:
                grid = []
                for block_n, block_k, split, warps, stages in itertools.product(
                        (16, 32, 64), (128, 256), (1, 2, 3, 4), (4,), (3, 5)):
                    if split > 1 and (k // split < block_k * 2 or n // block_n >= 264):
                        continue
                    config = gemv_mod.GemvConfig(block_n, block_k, split, warps, stages)
                    try:
                        ms = time_graph(lambda: [gemv_mod.gemv(x, w, config=config) for w in weights],
                                        replays=5) / copies
                    except Exception as exc:    # out of shared memory etc.: skip the point
                        print(f"  {name} {config}: {type(exc).__name__}", flush=True)
                        continue
                    grid.append({**asdict(config), "ms": ms, "tb_s": weight_bytes / ms / 1e9})
                grid.sort(key=lambda g: g["ms"])
                point["sweep_best"] = grid[:8]
            results.append(point)
            print(f"{name:8s} M={m:2d}: cuBLAS {point['cublas_tb_s']:.2f} TB/s  triton {point['triton_tb_s']:.2f} TB/s"
                  + (f"  (sweep best {point['sweep_best'][0]['tb_s']:.2f} TB/s: {point['sweep_best'][0]})"
                     if point.get("sweep_best") else ""), flush=True)
        del weights
        torch.cuda.empty_cache()
    return results


def chain(rows: int) -> dict:
    """The batch-`rows` decode GEMM chain of the Qwen-7B shape on one set of weights."""
    layers = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for name, (n, k) in QWEN7B.items()}
              for _ in range(LAYERS)]
    lm_head = torch.randn(*LM_HEAD, device="cuda", dtype=torch.bfloat16) * 0.02
    hidden = torch.randn(rows, 3584, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(rows, 18944, device="cuda", dtype=torch.bfloat16)
    weight_bytes = sum(w.numel() * 2 for layer in layers for w in layer.values()) + lm_head.numel() * 2

    def run(linear):
        for layer in layers:
            linear(hidden, layer["qkv"])
            linear(hidden, layer["o"])
            linear(hidden, layer["gate_up"])
            linear(act, layer["down"])
        linear(hidden, lm_head)

    cublas_ms = time_graph(lambda: run(F.linear))
    triton_ms = time_graph(lambda: run(gemv_mod.gemv))
    result = {"rows": rows, "weight_bytes": weight_bytes, "cublas_ms": cublas_ms, "triton_ms": triton_ms,
              "cublas_tb_s": weight_bytes / cublas_ms / 1e9, "triton_tb_s": weight_bytes / triton_ms / 1e9,
              "cublas_steps_per_s": 1e3 / cublas_ms, "triton_steps_per_s": 1e3 / triton_ms}
    print(f"chain M={rows}: cuBLAS {cublas_ms:.3f} ms ({result['cublas_tb_s']:.2f} TB/s)  "
          f"triton {triton_ms:.3f} ms ({result['triton_tb_s']:.2f} TB/s)", flush=True)
    del layers, lm_head
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--chain-rows", default="1,4")
    parser.add_argument("--sweep", default="", help="layers whose launch grid to sweep at M=1, e.g. qkv,o,down")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    record = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "copy_bandwidth_bytes_per_s": copy_bandwidth()}
    print(f"copy bandwidth {record['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    record["per_shape"] = per_shape([int(r) for r in args.rows.split(",")], [s for s in args.sweep.split(",") if s])
    record["chain"] = [chain(int(r)) for r in args.chain_rows.split(",")]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()

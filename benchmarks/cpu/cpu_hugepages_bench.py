"""Native CPU kernels over buffers in 4 KiB pages vs transparent huge pages (kvserve/kernels/cpu/hugepages.py).

Two passes shaped like the default model's decode steps (SmolLM2-135M: 30 layers, hidden 576,
intermediate 1536, 9/3 heads of 64, vocab 49152), each over data too large for the caches:
- weights: a batch-1 pass over all 30 layers' packed bf16 linears and the lm_head;
- attention: a batch-64 decode over 30 layers' bf16 KV caches (the engine's 1 GiB pool), contexts
  of 264 tokens in blocks scattered over the pool.
The plain and huge-page copies of the same data are timed alternately (this VM's speed drifts from
minute to minute), and the medians and each pair's ratio are reported.

    python benchmarks/cpu/cpu_hugepages_bench.py --json benchmarks/results/cpu/hugepages_kernels_ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvserve.eval.timing import Stopwatch, median  # noqa: E402
from kvserve.kernels import cpu as cpu_kernels  # noqa: E402
from kvserve.kernels.cpu import hugepages  # noqa: E402

LAYERS = 30
LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)


def _huge_copy(tensor: torch.Tensor) -> torch.Tensor:
    return hugepages.empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def weights_pass(weights: list[tuple[torch.Tensor, int]], inputs: dict[int, torch.Tensor]) -> float:
    with Stopwatch() as watch:
        for packed, out_features in weights:
            cpu_kernels.linear(inputs[packed.shape[1]], packed, out_features)
    return watch.ms


def attention_pass(caches, query, tables, lens) -> float:
    with Stopwatch() as watch:
        for k_cache, v_cache in caches:
            cpu_kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    return watch.ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not (cpu_kernels.available() and hugepages.available()):
        sys.exit("needs the native CPU kernels and Linux transparent huge pages")
    torch.manual_seed(0)
    plain_weights = [(cpu_kernels.pack_weight(torch.randn(n, k) * 0.02, bf16=True), n)
                     for _ in range(LAYERS) for n, k in LINEARS.values()]
    plain_weights.append((cpu_kernels.pack_weight(torch.randn(*LM_HEAD) * 0.02, bf16=True), LM_HEAD[0]))
    huge_weights = [(_huge_copy(packed), n) for packed, n in plain_weights]
    inputs = {k: torch.randn(1, k) for k in {k for _, k in LINEARS.values()}}

    batch, context, block_size, kv_heads, heads, head_dim = 64, 264, 16, 3, 9, 64
    num_blocks = 46592 // block_size
    plain_caches = [tuple(torch.randn(num_blocks, block_size, kv_heads, head_dim).to(torch.bfloat16) for _ in "kv")
                    for _ in range(LAYERS)]
    huge_caches = [tuple(_huge_copy(part) for part in pair) for pair in plain_caches]
    blocks_per_seq = -(-context // block_size)
    tables = torch.randperm(num_blocks)[:batch * blocks_per_seq].view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, heads, head_dim)

    weights_pass(plain_weights, inputs), weights_pass(huge_weights, inputs)      # warm-up
    result = {"command": "python " + " ".join(sys.argv), "torch_threads": torch.get_num_threads(),
              "fma_gflops_before": cpu_kernels.fma_gflops()}
    for name, run_plain, run_huge in (
            ("weights_batch1_ms", lambda: weights_pass(plain_weights, inputs), lambda: weights_pass(huge_weights, inputs)),
            ("attention_batch64_ms", lambda: attention_pass(plain_caches, query, tables, lens),
             lambda: attention_pass(huge_caches, query, tables, lens))):
        plain, huge = [], []
        for _ in range(args.pairs):
            plain.append(run_plain())
            huge.append(run_huge())
        result[name] = {"plain_4k_pages": [round(x, 2) for x in plain], "huge_pages": [round(x, 2) for x in huge],
                        "median_plain": round(median(plain), 2),
                        "median_huge": round(median(huge), 2),
                        "pair_speedups": [round(p / h, 3) for p, h in zip(plain, huge)]}
        print(f"{name}: plain {result[name]['median_plain']} ms, huge pages {result[name]['median_huge']} ms, "
              f"per-pair speedup {result[name]['pair_speedups']}")
    result["fma_gflops_after"] = cpu_kernels.fma_gflops()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

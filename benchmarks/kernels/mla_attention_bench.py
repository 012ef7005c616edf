"""MLA decode kernel bandwidth over the paged latent cache (CUDA).

For each (heads, batch, context): one decode step of the Triton kernel (kvserve.kernels.triton.
mla_decode) and of the torch reference, timed as CUDA-graph replays (launch overhead excluded), and
the effective bandwidth = bytes the step must read (latent + RoPE key of every context token,
bf16, plus block tables and queries) / time. The expanded-MHA bytes show what the same step would
read from a per-head K/V cache of the same model (for V2-Lite: see docs/deepseek.md).

    python benchmarks/kernels/mla_attention_bench.py --json benchmarks/results/kernels/h200_mla_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvserve.eval.timing import capture_graph, cuda_event_mean_ms  # noqa: E402
from kvserve.kernels import mla_reference  # noqa: E402


def graph_time_ms(fn, iters: int = 20) -> float:
    """Mean time of `fn` replayed from a CUDA graph (a decode step runs from one), CUDA events around
    `iters` back-to-back replays."""
    graph = capture_graph(fn, warmup=2)
    return cuda_event_mean_ms(graph.replay, iters, warmup=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="16,128", help="query heads (16: V2-Lite, 128: V3/R1)")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--nope-dim", type=int, default=128)
    parser.add_argument("--v-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-cache-gib", type=float, default=40.0, help="skip shapes whose cache exceeds this")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from kvserve.kernels.triton.mla_decode import mla_decode_attention
    device, dtype = torch.device("cuda"), torch.bfloat16
    rank, rope, block_size = args.rank, args.rope_dim, args.block_size
    token_bytes = (rank + rope) * 2
    rows = []
    print(f"{'heads':>5} {'batch':>5} {'context':>7} {'triton ms':>10} {'GB/s':>8} {'ref ms':>9} "
          f"{'MLA MB':>8} {'MHA MB':>8}")
    for heads in map(int, args.heads.split(",")):
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                tokens = batch * context
                if tokens * token_bytes > args.max_cache_gib * 2**30:
                    continue
                blocks_per_seq = -(-context // block_size)
                num_blocks = batch * blocks_per_seq
                latent_cache = torch.randn(num_blocks, block_size, 1, rank, device=device, dtype=dtype)
                rope_cache = torch.randn(num_blocks, block_size, 1, rope, device=device, dtype=dtype)
                # Shuffled blocks: a real pool is fragmented.
                tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
                lens = torch.full((batch,), context, dtype=torch.int32, device=device)
                q_latent = torch.randn(batch, heads, rank, device=device, dtype=dtype) * 0.05
                q_rope = torch.randn(batch, heads, rope, device=device, dtype=dtype) * 0.05
                out = torch.empty(batch, heads, rank, device=device, dtype=dtype)
                scale = (args.nope_dim + rope) ** -0.5

                def run_triton():
                    mla_decode_attention(q_latent, q_rope, latent_cache, rope_cache, tables, lens, scale, out=out)

                triton_ms = graph_time_ms(run_triton)
                read_bytes = tokens * token_bytes + tables.numel() * 4 + 2 * q_latent.numel() * 2
                ref_ms = None
                if not args.skip_reference and tokens * heads * 4 < 8 * 2**30:
                    expected = mla_reference.mla_decode_attention(q_latent, q_rope, latent_cache, rope_cache,
                                                                  tables.long(), lens, scale)
                    run_triton()
                    err = (out.float() - expected.float()).abs().max().item()
                    assert err < 5e-2, f"kernel vs reference: {err}"
                    ref_ms = graph_time_ms(lambda: mla_reference.mla_decode_attention(
                        q_latent, q_rope, latent_cache, rope_cache, tables.long(), lens, scale), iters=5)
                mha_bytes = tokens * heads * (args.nope_dim + rope + args.v_dim) * 2
                row = {"heads": heads, "batch": batch, "context": context, "triton_ms": round(triton_ms, 4),
                       "triton_gb_s": round(read_bytes / triton_ms / 1e6, 1),
                       "reference_ms": round(ref_ms, 4) if ref_ms is not None else None,
                       "mla_bytes": read_bytes, "expanded_mha_bytes": mha_bytes}
                rows.append(row)
                ref_text = f"{ref_ms:9.3f}" if ref_ms is not None else f"{'-':>9}"
                print(f"{heads:>5} {batch:>5} {context:>7} {triton_ms:>10.4f} {row['triton_gb_s']:>8.0f} {ref_text} "
                      f"{read_bytes / 1e6:>8.1f} {mha_bytes / 1e6:>8.1f}", flush=True)
                latent_cache = rope_cache = tables = None   # free before the next shape
                torch.cuda.empty_cache()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

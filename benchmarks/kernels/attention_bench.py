"""Attention micro-benchmark on CUDA: Triton paged decode attention against the copy bandwidth,
the torch reference and SDPA on the same (unpaged) data; plus a small Triton config sweep and a
prefill comparison.

Decode shape: R1-Distill-Qwen-7B attention (28 query heads, 4 KV heads, head_dim 128), bf16, KV
cache blocks of 16 tokens scattered at random over the cache. Metric: KV bytes read (K and V of
every context token, once) / kernel time, next to the device-to-device copy bandwidth measured in
the same run (bytes read + written / time). Times are triton.testing.do_bench medians (L2 flushed
before every repetition) of CUDA-graph replays for the Triton kernels and SDPA (GPU time, as a
graph-captured decode step sees it; eager times are in the JSON too), eager for the torch reference.

    python benchmarks/kernels/attention_bench.py --json benchmarks/results/kernels/h200_attention_bench.json

Runs in about 2-3 minutes on an H200; --quick runs a small subset.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvserve.eval.timing import do_bench_ms, graph_do_bench_ms, now, wall_mean_s  # noqa: E402
from kvserve.kernels import reference  # noqa: E402

GIB = 1024 ** 3
DEVICE = "cuda"   # a module global so that a CPU dry run (tests of this script) can swap it


def copy_bandwidth(num_bytes: int = 4 * GIB) -> dict:
    """Device-to-device copy of num_bytes: (bytes read + bytes written) / time."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src), warmup_ms=50, rep_ms=300)
    return {"bytes_copied": num_bytes, "ms": ms, "bandwidth_bytes_per_s": 2 * num_bytes / (ms * 1e-3)}


def make_paged_kv(batch: int, context_len: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, generator: torch.Generator):
    """Random K/V caches holding `batch` sequences of `context_len` tokens in randomly placed blocks."""
    blocks_per_seq = math.ceil(context_len / block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=DEVICE).normal_(generator=generator)
    v_cache = torch.empty(shape, dtype=dtype, device=DEVICE).normal_(generator=generator)
    permutation = torch.randperm(num_blocks - 1, device=DEVICE, generator=generator) + 1
    tables = permutation[:batch * blocks_per_seq].view(batch, blocks_per_seq).contiguous()
    return k_cache, v_cache, tables


def unpaged(cache: torch.Tensor, tables: torch.Tensor, context_len: int) -> torch.Tensor:
    """The same K (or V) as a contiguous [B, kv_heads, L, D] tensor, as SDPA wants it."""
    return reference.gather_blocks(cache, tables)[:, :context_len].transpose(1, 2).contiguous()


def decode_section(args, copy_bw: float) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    kv_bytes_per_token = 2 * args.kv_heads * args.head_dim * torch.tensor([], dtype=dtype).element_size()
    generator = torch.Generator(device=DEVICE)
    generator.manual_seed(0)
    rows = []
    for context_len in args.contexts:
        # Cache + an unpaged copy for SDPA + the reference's gathers and fp32 scores, with headroom.
        per_seq_peak = 4 * context_len * kv_bytes_per_token + 3 * context_len * args.heads * 4
        free = torch.cuda.mem_get_info()[0]
        batches = [b for b in args.batch_sizes if b * per_seq_peak < 0.85 * free]
        for skipped in sorted(set(args.batch_sizes) - set(batches)):
            rows.append({"context_len": context_len, "batch": skipped, "skipped": "does not fit in memory"})
            print(f"  skip context {context_len} batch {skipped}: does not fit")
        if batches:
            rows += decode_one_context(args, context_len, batches, dtype, copy_bw, generator)
        torch.cuda.empty_cache()
    return rows


def decode_one_context(args, context_len: int, batches: list[int], dtype: torch.dtype, copy_bw: float,
                       generator: torch.Generator) -> list[dict]:
    """Every batch size at one context length, on one cache sized for the largest batch."""
    from kvserve.kernels.triton import decode_num_splits, decode_workspace, paged_decode_attention
    num_heads, num_kv_heads, head_dim, block_size = args.heads, args.kv_heads, args.head_dim, args.block_size
    scale = head_dim ** -0.5
    kv_bytes_per_seq = 2 * context_len * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    k_cache, v_cache, all_tables = make_paged_kv(max(batches), context_len, num_kv_heads, head_dim, block_size,
                                                 dtype, generator)
    k_dense, v_dense = unpaged(k_cache, all_tables, context_len), unpaged(v_cache, all_tables, context_len)
    rows = []
    for batch in batches:
        tables = all_tables[:batch]
        lens = torch.full((batch,), context_len, dtype=torch.int32, device=DEVICE)
        query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=DEVICE, generator=generator)
        out = torch.empty_like(query)
        paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, out=out)   # compiles; notes occupancy
        num_splits = decode_num_splits(query, k_cache, tables)
        workspace = decode_workspace(batch, num_heads, head_dim, num_splits, query.device)
        kv_bytes = batch * kv_bytes_per_seq
        row = {"context_len": context_len, "batch": batch, "kv_bytes": kv_bytes, "num_splits": num_splits}

        def run_triton():
            paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, out=out,
                                   num_splits=num_splits, workspace=workspace)
        run_triton()
        row["triton_ms"] = graph_do_bench_ms(run_triton)
        row["triton_eager_ms"] = do_bench_ms(run_triton)

        # Accuracy guard on the first two sequences: SDPA in fp32 on the same data.
        check = min(batch, 2)
        q4 = query[:, :, None, :]
        expected = F.scaled_dot_product_attention(q4[:check].float(), k_dense[:check].float(),
                                                  v_dense[:check].float(), scale=scale, enable_gqa=True)[:, :, 0]
        row["triton_max_abs_err_vs_fp32"] = (out[:check].float() - expected).abs().max().item()
        expected = None

        def run_sdpa():
            F.scaled_dot_product_attention(q4, k_dense[:batch], v_dense[:batch], scale=scale, enable_gqa=True)
        try:
            row["sdpa_eager_ms"] = do_bench_ms(run_sdpa)
            row["sdpa_ms"] = graph_do_bench_ms(run_sdpa)
        except RuntimeError as error:        # no kernel for this shape, out of memory, or not capturable
            row["sdpa_error"] = str(error).splitlines()[0][:200]
            torch.cuda.empty_cache()
        # The reference gathers K and V (and may copy them again for the matmuls) plus fp32 scores.
        reference_peak = batch * (4 * kv_bytes_per_seq + 3 * context_len * num_heads * 4)
        if reference_peak < 0.8 * torch.cuda.mem_get_info()[0]:
            mask = torch.ones(batch, tables.shape[1] * block_size, dtype=torch.bool, device=DEVICE)
            mask[:, context_len:] = False
            try:
                row["torch_reference_ms"] = do_bench_ms(lambda: reference.paged_decode_attention(
                    query, k_cache, v_cache, tables, mask, scale), warmup_ms=5, rep_ms=50)
            except torch.cuda.OutOfMemoryError:
                row["torch_reference_skipped"] = "out of memory"
                torch.cuda.empty_cache()
        else:
            row["torch_reference_skipped"] = "does not fit in memory"
        for name in ("triton", "sdpa", "torch_reference"):
            if f"{name}_ms" in row:
                bandwidth = kv_bytes / (row[f"{name}_ms"] * 1e-3)
                row[f"{name}_kv_bytes_per_s"] = bandwidth
                row[f"{name}_fraction_of_copy_bw"] = bandwidth / copy_bw
        rows.append(row)
        print(format_decode_row(row), flush=True)
    return rows


def format_decode_row(row: dict) -> str:
    def cell(name: str) -> str:
        if f"{name}_ms" not in row:
            return f"{'-':>9} {'-':>6} {'-':>5}"
        return (f"{row[f'{name}_ms'] * 1e3:9.1f} {row[f'{name}_kv_bytes_per_s'] / 1e12:6.2f} "
                f"{100 * row[f'{name}_fraction_of_copy_bw']:4.0f}%")
    return (f"{row['context_len']:>7} {row['batch']:>5} {row['num_splits']:>6} {row['kv_bytes'] / GIB:8.3f}  "
            f"{cell('triton')}  {cell('sdpa')}  {cell('torch_reference')}")


DECODE_HEADER = (f"{'context':>7} {'batch':>5} {'splits':>6} {'KV GiB':>8}  "
                 f"{'triton us':>9} {'TB/s':>6} {'%cp':>5}  {'sdpa us':>9} {'TB/s':>6} {'%cp':>5}  "
                 f"{'ref us':>9} {'TB/s':>6} {'%cp':>5}")


# (label, heads, kv_heads, head_dim, batch, context)
SWEEP_SHAPES = [
    ("qwen7b", 28, 4, 128, 1, 131072), ("qwen7b", 28, 4, 128, 16, 4096), ("qwen7b", 28, 4, 128, 64, 4096),
    ("qwen7b", 28, 4, 128, 64, 32768), ("smollm2", 9, 3, 64, 8, 4096),
]
# (label, [(query_len, cached prefix_len) per chunk of one step])
PREFILL_CASES = [
    ("8 prompts x 512", [(512, 0)] * 8), ("32 prompts x 128", [(128, 0)] * 32), ("1 prompt x 4096", [(4096, 0)]),
    ("chunk 512 over 4k prefix", [(512, 4096)]), ("chunk 512 over 32k prefix", [(512, 32768)]),
    ("4 chunks 256 over 2k prefix", [(256, 2048)] * 4),
]


def sweep_section(args, copy_bw: float) -> list[dict]:
    """Decode configs (tile, warps, stages, dot vs broadcast, split count) at a few shapes, so the
    defaults in kvserve/kernels/triton/decode_attention.py can be set from measurements."""
    generator = torch.Generator(device=DEVICE)
    generator.manual_seed(1)
    results = []
    for shape in args.sweep_shapes or SWEEP_SHAPES:
        results += sweep_one_shape(args, shape, copy_bw, generator)
        torch.cuda.empty_cache()
    return results


def sweep_one_shape(args, shape: tuple, copy_bw: float, generator: torch.Generator) -> list[dict]:
    from kvserve.kernels.triton import decode_num_splits, decode_workspace, paged_decode_attention
    from kvserve.kernels.triton.decode_attention import DecodeConfig, default_decode_config
    label, num_heads, num_kv_heads, head_dim, batch, context_len = shape
    dtype = getattr(torch, args.dtype)
    k_cache, v_cache, tables = make_paged_kv(batch, context_len, num_kv_heads, head_dim, args.block_size,
                                             dtype, generator)
    lens = torch.full((batch,), context_len, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=DEVICE, generator=generator)
    out = torch.empty_like(query)
    kv_bytes = 2 * batch * context_len * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, out=out)  # notes occupancy
    auto_splits = decode_num_splits(query, k_cache, tables)
    default = default_decode_config(head_dim, dtype)
    configs = [DecodeConfig(tile=t, num_warps=w, num_stages=s) for t in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
    configs += [DecodeConfig(tile=16, num_warps=4, num_stages=2, use_dot=False),
                DecodeConfig(tile=32, num_warps=4, num_stages=2, use_dot=False)]
    trials = [(default, auto_splits)] + [(config, auto_splits) for config in configs if config != default]
    trials += [(default, splits) for splits in sorted({1, 2, 3, 4, 5, 6, 8, max(1, auto_splits // 2),
                                                        auto_splits * 2} - {auto_splits})]
    results = []
    for config, splits in trials:
        workspace = decode_workspace(batch, num_heads, head_dim, splits, query.device)
        row = {"shape": label, "batch": batch, "context_len": context_len, "config": vars(config),
               "num_splits": splits, "default": config == default and splits == auto_splits}

        def run():
            paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, out=out,
                                   num_splits=splits, workspace=workspace, config=config)
        try:
            row["ms"] = graph_do_bench_ms(run, warmup_ms=10, rep_ms=40)
        except Exception as error:  # a config that does not compile (e.g. out of shared memory)
            row["error"] = str(error)[:200]
            results.append(row)
            continue
        row["kv_bytes_per_s"] = kv_bytes / (row["ms"] * 1e-3)
        row["fraction_of_copy_bw"] = row["kv_bytes_per_s"] / copy_bw
        results.append(row)
    timed = [r for r in results if "ms" in r]
    best, mine = min(timed, key=lambda r: r["ms"]), results[0]

    def describe(r: dict) -> str:
        if "ms" not in r:
            return "failed"
        return f"{r['ms'] * 1e3:.1f} us ({100 * r['fraction_of_copy_bw']:.0f}% of copy bw)"
    print(f"  {label} batch {batch} context {context_len}: default {describe(mine)}; best {describe(best)} "
          f"with {best['config']} splits {best['num_splits']}", flush=True)
    return results


def prefill_section(args) -> list[dict]:
    """Triton varlen prefill vs SDPA (plain prompts, one call per prompt, as TorchAttentionBackend
    does) and vs the torch reference (chunks over a cached prefix), Qwen-7B heads, bf16."""
    generator = torch.Generator(device=DEVICE)
    generator.manual_seed(2)
    results = []
    for label, specs in PREFILL_CASES:
        results.append(prefill_one_case(args, label, specs, generator))
        torch.cuda.empty_cache()
    return results


def prefill_one_case(args, label: str, specs: list[tuple[int, int]], generator: torch.Generator) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvserve.attention.metadata import PrefillChunk
    from kvserve.kernels.triton import paged_prefill_attention, plan_prefill
    from kvserve.kernels.triton import references
    num_heads, num_kv_heads, head_dim, block_size = args.heads, args.kv_heads, args.head_dim, args.block_size
    dtype = getattr(torch, args.dtype)
    scale = head_dim ** -0.5
    num_blocks = sum(math.ceil((q + p) / block_size) for q, p in specs) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=DEVICE).normal_(generator=generator)
    v_cache = torch.empty(shape, dtype=dtype, device=DEVICE).normal_(generator=generator)
    permutation = (torch.randperm(num_blocks - 1, device=DEVICE, generator=generator) + 1).tolist()
    chunks, slot_parts, offset, used = [], [], 0, 0
    for query_len, prefix_len in specs:
        context_len = query_len + prefix_len
        count = math.ceil(context_len / block_size)
        table = torch.tensor(permutation[used:used + count], device=DEVICE)
        used += count
        positions = torch.arange(context_len, device=DEVICE)
        slots = table[positions // block_size] * block_size + positions % block_size
        chunks.append(PrefillChunk(offset, query_len, context_len, slots if prefix_len else None))
        slot_parts.append(slots[prefix_len:])
        offset += query_len
    slot_mapping = torch.cat(slot_parts)
    query = torch.randn(offset, num_heads, head_dim, dtype=dtype, device=DEVICE, generator=generator)
    key = torch.randn(offset, num_kv_heads, head_dim, dtype=dtype, device=DEVICE, generator=generator)
    value = torch.randn_like(key)
    reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
    out = torch.empty_like(query)
    plan = plan_prefill(chunks, slot_mapping)
    # Causal FLOPs (QK^T and PV): each query attends to the prefix and to itself and earlier chunk tokens.
    flops = sum(4 * num_heads * head_dim * (q * p + q * (q + 1) / 2) for q, p in specs)
    row = {"case": label, "chunks": specs, "flops": flops}
    row["triton_ms"] = do_bench_ms(lambda: paged_prefill_attention(query, k_cache, v_cache, plan, scale, out=out))
    row["plan_prefill_host_ms"] = wall_mean_s(lambda: plan_prefill(chunks, slot_mapping), 20, DEVICE) * 1e3

    def torch_loop():      # what TorchAttentionBackend does: SDPA per plain prompt, gathers + SDPA per chunk
        for chunk in chunks:
            span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.context_slots is None:
                reference.prefill_attention(query[span], key[span], value[span], scale)
            else:
                reference.paged_prefill_attention(query[span], k_cache, v_cache, chunk.context_slots, scale)
    other = "sdpa" if all(p == 0 for _, p in specs) else "torch_reference"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        row[f"{other}_ms"] = do_bench_ms(torch_loop, warmup_ms=10, rep_ms=50)
        expected = references.paged_prefill_attention(query, k_cache, v_cache, chunks, slot_mapping, scale)
    row["triton_max_abs_err_vs_torch"] = (out.float() - expected.float()).abs().max().item()
    for name in ("triton", other):
        row[f"{name}_tflops"] = flops / (row[f"{name}_ms"] * 1e-3) / 1e12
    print(f"  {label:<28} triton {row['triton_ms'] * 1e3:9.1f} us ({row['triton_tflops']:6.1f} TFLOP/s)   "
          f"{other} {row[f'{other}_ms'] * 1e3:9.1f} us ({row[f'{other}_tflops']:6.1f} TFLOP/s)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--contexts", default="4096,32768,131072")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--no-sweep", action="store_true", help="skip the decode config sweep")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill comparison")
    parser.add_argument("--quick", action="store_true", help="contexts 4096,32768, batches 1,8,64, no sweep")
    parser.add_argument("--sweep-shapes", default=None,
                        help="the sweep's shapes instead of the built-in ones: label:heads:kv_heads:head_dim:batch:context,...")
    parser.add_argument("--sweep-only", action="store_true", help="only the decode config sweep")
    args = parser.parse_args(argv)
    if args.sweep_shapes:
        args.sweep_shapes = [(label, *map(int, rest)) for label, *rest in
                             (spec.split(":") for spec in args.sweep_shapes.split(","))]
    if args.quick:
        args.contexts, args.batch_sizes, args.no_sweep = "4096,32768", "1,8,64", True
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    if not torch.cuda.is_available():
        print("attention_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton
    started = now()
    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(),
              "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                        "block_size": args.block_size, "dtype": args.dtype}}
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    copy = copy_bandwidth()
    result["copy"] = copy
    copy_bw = copy["bandwidth_bytes_per_s"]
    print(f"device copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write of {copy['bytes_copied'] / GIB:.0f} GiB)")
    if args.sweep_only:
        print("\ndecode config sweep")
        result["sweep"] = sweep_section(args, copy_bw)
        return _finish(args, result, started)
    print(f"\ndecode attention, {args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}, {args.dtype}, "
          f"block {args.block_size}: KV bytes read / time (%cp = share of the copy bandwidth)")
    print(DECODE_HEADER)
    result["decode"] = decode_section(args, copy_bw)
    from kvserve.kernels.triton.decode_attention import measured_occupancy
    result["decode_programs_per_sm"] = measured_occupancy()
    print(f"split kernel occupancy (programs per SM): {result['decode_programs_per_sm']}")
    if not args.no_sweep:
        print("\ndecode config sweep")
        result["sweep"] = sweep_section(args, copy_bw)
    if not args.no_prefill:
        print("\nprefill attention (Triton varlen paged kernel vs SDPA / torch reference)")
        result["prefill"] = prefill_section(args)
    return _finish(args, result, started)


def _finish(args, result: dict, started: float) -> int:
    result["wall_s"] = now() - started
    print(f"\ndone in {result['wall_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode attention over a quantized paged KV cache on CUDA: kernel time per KV format vs bf16.

Shape: 32k context, batch 32 (the reference point), R1-Distill-Qwen-7B attention (28 query heads,
4 KV heads, head_dim 128) and Llama-8B (32 / 8 / 128), bf16 queries, blocks of 16 tokens scattered
at random. The bf16 row is the full-precision Triton kernel (kernels/triton/decode_attention.py);
the others are the fused-dequant kernel (kernels/triton/decode_attention_quant.py) over random
payload bytes and scales of each format. Each kernel runs once first and then takes the split count
it picks from its measured occupancy (what a serving step does after its first launch). Times are
CUDA-graph replay medians (triton.testing.do_bench, L2 flushed); GB/s is the KV bytes a step must
read (payload + scales) over that time. Also times the quantize-on-write store kernel for one
decode step's 32 tokens, and optionally (--e2e) end-to-end decode tok/s through the engine at long
context with dummy weights. --sweep times launch variants of the quantized kernel (tile, warps,
pipeline stages, value staging, PTX conversion) per format.

    python benchmarks/kernels/kv_quant_attention_bench.py --json benchmarks/results/kernels/h200_kv_quant_attention.json
    python benchmarks/kernels/kv_quant_attention_bench.py --quick           # 8k context, one shape
    python benchmarks/kernels/kv_quant_attention_bench.py --sweep --shapes qwen7b --formats int8,fp8_e4m3,int4-g32
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvserve.eval.timing import Stopwatch, graph_do_bench_ms  # noqa: E402
from kvserve.kvstore import KVCacheStore, build_kv_cache_spec  # noqa: E402

FORMATS = {
    "bf16": {"kv_cache_dtype": "bf16"},
    "int8": {"kv_cache_dtype": "int8"},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    # int4 with keys per token (scales per group of 32-128, as the values), with or without a window.
    "int4-g32": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 0, "kv_quant_sinks": 0,
                 "kv_quant_key_layout": "token"},
    "int4-g32-w128-s4": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 128,
                         "kv_quant_sinks": 4, "kv_quant_key_layout": "token"},
    "int4-g64": {"kv_cache_dtype": "int4", "kv_quant_group_size": 64, "kv_quant_window": 0, "kv_quant_sinks": 0,
                 "kv_quant_key_layout": "token"},
    "int4-g128": {"kv_cache_dtype": "int4", "kv_quant_group_size": 128, "kv_quant_window": 0, "kv_quant_sinks": 0,
                  "kv_quant_key_layout": "token"},
    "k-int8/v-fp8": {"kv_cache_dtype_k": "int8", "kv_cache_dtype_v": "fp8_e4m3"},
    # int4 keys per channel and block (KIVI), values per token in groups of 32, no window.
    "int4-kchannel": {"kv_cache_dtype": "int4", "kv_quant_key_layout": "channel"},
}
SHAPES = {"qwen7b": (28, 4, 128), "llama8b": (32, 8, 128)}


def random_fill(cache, generator: torch.Generator) -> None:
    """Random bytes of the format in place (quantizing 2^20 tokens would only slow the setup)."""
    if isinstance(cache, torch.Tensor):
        cache.normal_(generator=generator)
        return
    payload = cache.payload
    if cache.fmt.name == "fp8_e4m3":
        payload.copy_(torch.randn(payload.shape, device=payload.device, generator=generator)
                      .to(torch.float8_e4m3fn).view(torch.uint8))
    else:
        payload.copy_(torch.randint(-127 if payload.dtype == torch.int8 else 0, 128 if payload.dtype == torch.int8
                                    else 256, payload.shape, device=payload.device, generator=generator,
                                    dtype=torch.int32).to(payload.dtype))
    if cache.scales is not None:
        cache.scales.uniform_(0.005, 0.02, generator=generator)
    if cache.window is not None:
        cache.window.normal_(generator=generator)


def make_caches(shape_name: str, fmt_name: str, context_len: int, batch: int, block_size: int):
    heads, kv_heads, head_dim = SHAPES[shape_name]
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    spec = build_kv_cache_spec(1, kv_heads, head_dim, torch.bfloat16, **FORMATS[fmt_name])
    blocks_per_seq = context_len // block_size
    num_blocks = batch * blocks_per_seq + 1
    k_cache, v_cache = KVCacheStore.allocate(spec, num_blocks, block_size, device, num_rows=batch)[0]
    random_fill(k_cache, generator)
    random_fill(v_cache, generator)
    tables = torch.randperm(num_blocks - 1, device=device, generator=generator)[:batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context_len, dtype=torch.int32, device=device)
    rows = torch.arange(batch, device=device)
    query = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device, generator=generator)
    return spec, k_cache, v_cache, tables, context_lens, rows, query, generator


def quant_attention_ms(spec, k_cache, v_cache, tables, context_lens, rows, query, **options) -> tuple[float, int]:
    """(graph-replay ms, split count) of the quantized kernel with its own split choice."""
    from kvserve.kernels.triton.decode_attention import decode_workspace
    from kvserve.kernels.triton.decode_attention_quant import decode_num_splits_quant, paged_decode_attention_quant
    batch, heads, head_dim = query.shape
    scale = head_dim ** -0.5
    seq_rows = rows if spec.needs_rows else None
    out = torch.empty_like(query)
    paged_decode_attention_quant(query, k_cache, v_cache, tables, context_lens, scale, seq_rows, out=out,
                                 **options)                         # compile, measure occupancy
    split_options = {k: v for k, v in options.items() if k in ("config", "implementation", "asm", "value_staging")}
    num_splits = decode_num_splits_quant(query, k_cache, v_cache, tables, **split_options)
    workspace = decode_workspace(batch, heads, head_dim, num_splits + 1, query.device)  # +1: a window's partial

    def attend():
        paged_decode_attention_quant(query, k_cache, v_cache, tables, context_lens, scale, seq_rows, out=out,
                                     num_splits=num_splits, workspace=workspace, **options)
    return graph_do_bench_ms(attend), num_splits


def one_point(shape_name: str, fmt_name: str, context_len: int, batch: int, block_size: int,
              launch: dict | None = None, implementation: str = "auto",
              pipelined: tuple[int, ...] | None = None) -> dict:
    """One (shape, format) point; `launch` (tile, num_warps, num_stages, value_staging, asm) overrides
    the fast Triton kernel's default launch, `pipelined` (tile, stages) the pipelined kernel's;
    `implementation` picks the quantized kernel (auto: what the engine runs)."""
    from kvserve.kernels.triton import paged_decode_attention, store_kv
    from kvserve.kernels.triton.decode_attention import decode_num_splits, decode_workspace
    from kvserve.kernels.triton.kv_store_quant import store_quantized
    spec, k_cache, v_cache, tables, context_lens, rows, query, generator = make_caches(
        shape_name, fmt_name, context_len, batch, block_size)
    heads, kv_heads, head_dim = SHAPES[shape_name]
    scale = head_dim ** -0.5
    quantized = not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor))
    kernel = "bf16"
    if quantized:
        from kvserve.kernels.triton.decode_attention_quant import quant_decode_kernel
        options = {"implementation": implementation}
        if pipelined:
            from dataclasses import replace

            from kvserve.kernels.triton.decode_attention_quant_pipelined import pipelined_config
            base = pipelined_config(kv_heads, fmt_name.startswith("int4"))
            options.update(config=replace(base, tile=pipelined[0], num_stages=pipelined[1],
                                          max_registers=pipelined[2] if len(pipelined) > 2 else None),
                           implementation="pipelined")
        elif launch:
            from dataclasses import replace

            from kvserve.kernels.triton.decode_attention_quant_config import default_quant_decode_config
            options = dict(config=replace(default_quant_decode_config(head_dim, query.dtype), tile=launch["tile"],
                                          num_warps=launch["num_warps"], num_stages=launch["num_stages"]),
                           value_staging=launch["value_staging"], asm=launch["asm"], implementation="fast")
        kernel = quant_decode_kernel(query, k_cache, v_cache, options.get("config"), options["implementation"])
        attention_ms, num_splits = quant_attention_ms(spec, k_cache, v_cache, tables, context_lens, rows, query,
                                                      **options)
    else:
        out = torch.empty_like(query)
        paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale, out=out)
        num_splits = decode_num_splits(query, k_cache, tables, context_len)
        workspace = decode_workspace(batch, heads, head_dim, num_splits, query.device)

        def attend():
            paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale, out=out,
                                   num_splits=num_splits, workspace=workspace)
        attention_ms = graph_do_bench_ms(attend)

    new_k = torch.randn(batch, kv_heads, head_dim, dtype=torch.bfloat16, device=query.device, generator=generator)
    slots = (tables[:, -1].long() * block_size + block_size - 1)
    if quantized:
        def store():
            for cache in (k_cache, v_cache):
                if isinstance(cache, torch.Tensor):
                    store_kv(new_k, new_k, cache, cache, slots)
                else:
                    store_quantized(new_k, cache, slots)
    else:
        def store():
            store_kv(new_k, new_k, k_cache, v_cache, slots)
    store_ms = graph_do_bench_ms(store)
    kv_bytes = batch * context_len * spec.bytes_per_token
    if pipelined:
        launch_name = f"tile {pipelined[0]}, {pipelined[1]} stages" + (f", {pipelined[2]} regs" if len(pipelined) > 2
                                                                      else "")
    else:
        launch_name = launch or "default"
    return {"shape": shape_name, "format": fmt_name, "context_len": context_len, "batch": batch,
            "kernel": kernel, "num_splits": num_splits,
            "launch": launch_name, "bytes_per_token_per_layer": spec.bytes_per_token,
            "attention_ms": round(attention_ms, 4), "store_ms": round(store_ms, 4),
            "kv_gb_per_s": round(kv_bytes / attention_ms / 1e6, 1)}


SWEEP = [  # (tile, num_warps, num_stages, value_staging, asm); each shape is covered by the tests
    (64, 4, 2, "fp16", True), (64, 4, 3, "fp16", True), (32, 4, 2, "fp16", True), (32, 4, 3, "fp16", True),
    (128, 8, 2, "fp16", True), (64, 4, 2, "codes", True), (32, 4, 2, "codes", True), (32, 4, 2, "fp16", False),
]


def sweep_section(shapes: list[str], formats: list[str], context_len: int, batch: int, block_size: int) -> list[dict]:
    from dataclasses import replace

    from kvserve.kernels.triton.decode_attention_quant_config import default_quant_decode_config
    rows_out = []
    for shape_name in shapes:
        for fmt_name in formats:
            if fmt_name == "bf16":
                continue
            spec, k_cache, v_cache, tables, context_lens, rows, query, _ = make_caches(
                shape_name, fmt_name, context_len, batch, block_size)
            base = default_quant_decode_config(query.shape[2], query.dtype)
            for tile, warps, stages, staging, asm in SWEEP:
                config = replace(base, tile=tile, num_warps=warps, num_stages=stages)
                try:
                    ms, splits = quant_attention_ms(spec, k_cache, v_cache, tables, context_lens, rows, query,
                                                    config=config, asm=asm, value_staging=staging)
                except Exception as exc:                     # a variant that does not compile
                    print(f"sweep {shape_name} {fmt_name} {tile}/{warps}/{stages}/{staging}/{asm}: {exc!r}"[:300])
                    continue
                gbs = batch * context_len * spec.bytes_per_token / ms / 1e6
                row = {"shape": shape_name, "format": fmt_name, "tile": tile, "num_warps": warps,
                       "num_stages": stages, "value_staging": staging, "asm": asm, "num_splits": splits,
                       "attention_ms": round(ms, 4), "kv_gb_per_s": round(gbs, 1)}
                rows_out.append(row)
                print(f"sweep {shape_name:<8}{fmt_name:<18} tile {tile:>3} warps {warps} stages {stages} "
                      f"{staging:<5} asm {int(asm)} splits {splits:>3} {ms:8.4f} ms {gbs:7.0f} GB/s", flush=True)
            del k_cache, v_cache
            torch.cuda.empty_cache()
    return rows_out


def e2e_section(formats: list[str], input_len: int, output_len: int, batch: int) -> list[dict]:
    """Engine tok/s with dummy R1-Distill-Qwen-7B weights, per KV format: the whole run (prefill
    included), and the decode steps alone, timed in a run of their own once every prompt is computed
    (the device synchronized before and after)."""
    from kvserve.eval.bench import bench_kvserve
    from kvserve.engine.engine import Engine
    rows = []
    for fmt_name in formats:
        # A fixed KV budget: the default (a fraction of free memory) would leave the next format's
        # engine no room while this one's memory is still being released.
        engine = Engine.from_options(model=str(ROOT / "benchmarks" / "configs" / "r1-distill-qwen-7b"),
                                     load_format="dummy", max_num_seqs=batch, max_model_len=input_len + output_len,
                                     kv_cache_memory=40 * 2**30, **FORMATS[fmt_name])
        bench_kvserve(engine, 1, 16, 4, 1, 0)
        point = bench_kvserve(engine, batch, input_len, output_len, 1, 0)
        decode_s, decode_steps = timed_decode(engine, batch, input_len, output_len, seed=1)
        rows.append({"format": fmt_name, "batch": batch, "input_len": input_len, "output_len": output_len,
                     "output_tokens_per_s": round(point.output_tokens_per_s, 1), "seconds": round(point.seconds, 3),
                     "decode_steps": decode_steps, "decode_s": round(decode_s, 3),
                     "decode_step_ms": round(decode_s / decode_steps * 1e3, 3),
                     "decode_tokens_per_s": round(batch * (output_len - 1) / decode_s, 1),
                     "kv_capacity_tokens": engine.kv_manager.capacity_tokens,
                     "kv_bytes_per_token": engine.kv_bytes_per_token})
        print(rows[-1], flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def timed_decode(engine, batch: int, input_len: int, output_len: int, seed: int) -> tuple[float, int]:
    """Seconds and engine steps from the moment every prompt of a batch is computed (their first
    tokens sampled) until the last request finishes: the batch's output_len - 1 decode steps (plus
    the step that only collects the last tokens, with overlapped scheduling)."""
    from kvserve.eval.bench import random_prompts, step_until_prompts_computed
    from kvserve.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind="final_only")
    for prompt in random_prompts(batch, input_len, engine.model.config.vocab_size, seed):
        engine.add_request(None, {"prompt_token_ids": prompt}, params)
    step_until_prompts_computed(engine)
    steps = 0
    with Stopwatch("cuda") as watch:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    return watch.seconds, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-len", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--shapes", default="qwen7b,llama8b")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--quick", action="store_true", help="8k context, qwen7b shape only")
    parser.add_argument("--e2e", action="store_true", help="also engine decode tok/s (dummy 7B weights)")
    parser.add_argument("--e2e-input-len", type=int, default=16384)
    parser.add_argument("--e2e-output-len", type=int, default=64)
    parser.add_argument("--e2e-batch", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="time launch variants of the quantized kernel")
    parser.add_argument("--launch-from", default=None,
                        help="a --sweep JSON: each format runs with its fastest launch there (any shape)")
    parser.add_argument("--implementation", default="auto", choices=["auto", "pipelined", "fast"],
                        help="the quantized kernel (auto: the engine's choice)")
    parser.add_argument("--pipelined-launches", default="",
                        help="also time the pipelined kernel at these TILE:STAGES[:MAX_REGISTERS] launches, "
                             "e.g. 64:3,64:2:128")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.quick:
        args.context_len, args.shapes = 8192, "qwen7b"
    formats = [f for f in args.formats.split(",") if f]
    if args.sweep:
        from kvserve.kernels.triton.decode_attention_quant import measured_quant_occupancy
        rows = sweep_section(args.shapes.split(","), formats, args.context_len, args.batch, args.block_size)
        record = {"command": "python benchmarks/kernels/kv_quant_attention_bench.py " + " ".join(argv or sys.argv[1:]),
                  "gpu": torch.cuda.get_device_name(), "sweep": rows, "occupancy": measured_quant_occupancy()}
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record, indent=2))
        return 0
    launches = {}
    if args.launch_from:
        for row in json.loads(Path(args.launch_from).read_text())["sweep"]:
            best = launches.get(row["format"])
            if best is None or row["attention_ms"] < best[0]:
                launches[row["format"]] = (row["attention_ms"], {k: row[k] for k in (
                    "tile", "num_warps", "num_stages", "value_staging", "asm")})
    points = []
    for shape in args.shapes.split(","):
        for fmt_name in formats:
            family = "int4-g32" if fmt_name.startswith("int4") else ("int8" if "int8" in fmt_name else fmt_name)
            launch = launches.get(fmt_name, launches.get(family, (None, None)))[1]
            point = one_point(shape, fmt_name, args.context_len, args.batch, args.block_size, launch,
                              args.implementation)
            points.append(point)
            torch.cuda.empty_cache()
            if point["kernel"] == "pipelined" or (fmt_name != "bf16" and args.implementation == "pipelined"):
                for item in filter(None, args.pipelined_launches.split(",")):
                    points.append(one_point(shape, fmt_name, args.context_len, args.batch, args.block_size,
                                            implementation="pipelined",
                                            pipelined=tuple(int(v) for v in item.split(":"))))
                    torch.cuda.empty_cache()
    for point in points:
        base = next((p for p in points if p["shape"] == point["shape"] and p["format"] == "bf16"), None)
        point["speedup_vs_bf16"] = round(base["attention_ms"] / point["attention_ms"], 3) if base else float("nan")
    header = (f"{'shape':<9}{'format':<20}{'kernel':<10}{'launch':<20}{'B/tok/layer':>12}{'splits':>7}{'attn ms':>10}"
              f"{'GB/s':>9}{'vs bf16':>9}"
              f"{'store ms':>10}")
    print(header)
    for p in points:
        print(f"{p['shape']:<9}{p['format']:<20}{p['kernel']:<10}{str(p['launch'])[:19]:<20}"
              f"{p['bytes_per_token_per_layer']:>12}{p['num_splits']:>7}"
              f"{p['attention_ms']:>10.3f}{p['kv_gb_per_s']:>9.0f}{p['speedup_vs_bf16']:>9.2f}{p['store_ms']:>10.4f}")
    import triton

    from kvserve.kernels.triton.decode_attention_quant import measured_quant_occupancy
    record = {"command": "python benchmarks/kernels/kv_quant_attention_bench.py " + " ".join(argv or sys.argv[1:]),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "platform": platform.platform(), "points": points,
              "quant_kernel_programs_per_sm": measured_quant_occupancy()}
    if args.e2e:
        record["e2e"] = e2e_section(formats, args.e2e_input_len, args.e2e_output_len, args.e2e_batch)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

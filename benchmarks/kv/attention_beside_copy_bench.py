"""What a host-to-GPU copy on another stream costs the decode attention kernel beside it.

In host_load_bench.py a decode step beside a load from the host tier ran 8-10% slower on an H100,
and a profile put the extra time in the split-KV attention kernel and its combine (+39% / +24%),
not in the GEMMs; one program of the block-copy kernel cost as much as four. This bench isolates
that: the engine's paged decode attention (R1-Distill-Qwen-7B shape: 28 heads, 4 KV heads, head
dim 128, bf16; batch 32, 512-token contexts, 28 launches = one step's layers, in a CUDA graph) timed alone, then
while each of these moves `--blocks` KV blocks from pinned host memory on a stream of its own:
- the block-copy kernel reading host rows from SMs, at several grid sizes;
- the copy engine: one pinned memcpy of the same bytes (no SM involved);
- the copy engine into a staging buffer, then one device-to-device scatter kernel per slot (the
  engine's copy-engine load path, `load_by_copy_engine`).
Each copy is started first and outlasts the attention loop, so every timed launch has it beside.
Medians of `--repeats`; the side-by-side ratios are what to read.

    python benchmarks/kv/attention_beside_copy_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable, Optional

import torch


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=1024, help="KV blocks the copy moves (of the whole model)")
    parser.add_argument("--steps", type=int, default=8, help="steps of attention launches timed per copy")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    from kvserve.kernels.triton.block_copy import copy_block_rows
    from kvserve.kernels.triton.decode_attention import paged_decode_attention

    device = torch.device("cuda")
    dtype = torch.bfloat16
    blocks_per_seq = -(-args.context // args.block_size)
    cache_blocks = args.batch * blocks_per_seq
    k_cache = torch.randn(cache_blocks, args.block_size, args.kv_heads, args.head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(cache_blocks, device=device, dtype=torch.int32).view(args.batch, blocks_per_seq)
    lens = torch.full((args.batch,), args.context, device=device, dtype=torch.int32)
    query = torch.randn(args.batch, args.heads, args.head_dim, device=device, dtype=dtype)
    out = torch.empty_like(query)
    scale = args.head_dim ** -0.5

    # Captured in a CUDA graph, as the engine's decode steps are: launched one by one from Python
    # the loop is bound by the host's launch time, not by the kernel.
    for _ in range(2):
        paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, out=out)    # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.steps * args.layers):
            paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, out=out)

    def attention_steps() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / args.steps

    # The copy's source and destination: `blocks` rows of a block's bytes for the whole model.
    block_nbytes = 2 * args.layers * args.block_size * args.kv_heads * args.head_dim * dtype.itemsize
    piece_nbytes = block_nbytes // (2 * args.layers)
    host = torch.empty(args.blocks, block_nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    pieces = [torch.empty(2 * args.blocks, piece_nbytes, dtype=torch.uint8, device=device)
              for _ in range(2 * args.layers)]
    staging = torch.empty(args.blocks, block_nbytes, dtype=torch.uint8, device=device)
    copy_stream = torch.cuda.Stream()
    destinations = torch.randperm(2 * args.blocks)[:args.blocks]       # scattered, as a tier's free list
    rows = torch.arange(args.blocks)
    device_destinations = destinations.to(device)

    def kernel_load(programs: int) -> Callable[[], None]:
        return lambda: copy_block_rows(pieces, destinations, [host], rows, args.blocks, to_rows=False,
                                       max_programs=programs)

    def memcpy_load() -> None:
        staging.copy_(host, non_blocking=True)

    def staged_load() -> None:
        staging.copy_(host, non_blocking=True)
        views = staging.view(args.blocks, 2 * args.layers, piece_nbytes)
        for index, piece in enumerate(pieces):
            piece.index_copy_(0, device_destinations, views[:, index])

    copies: dict[str, Callable[[], None]] = {f"kernel_{p}_programs": kernel_load(p) for p in (1, 4, 16)}
    copies["copy_engine_memcpy"] = memcpy_load
    copies["copy_engine_then_scatter"] = staged_load

    results: dict = {"device": torch.cuda.get_device_name(), "copy_bytes": args.blocks * block_nbytes}
    for _ in range(2):
        attention_steps()                                   # compiles and warms
    for copy in copies.values():                            # the same for each copy
        with torch.cuda.stream(copy_stream):
            copy()
    torch.cuda.synchronize()

    def alone() -> float:
        return statistics.median(attention_steps() for _ in range(args.repeats))

    results["attention_step_alone_s"] = alone()
    for name, copy in copies.items():
        beside, copy_seconds = [], []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(copy_stream):
                start.record()
                copy()
                end.record()
            beside.append(attention_steps())
            end.synchronize()
            copy_seconds.append(start.elapsed_time(end) / 1e3)
        attention_alone = alone()          # measured again next to each copy: drift shows as noise, not as a cost
        row = {"attention_step_beside_s": statistics.median(beside), "attention_step_alone_s": attention_alone,
               "slowdown": statistics.median(beside) / attention_alone - 1,
               "copy_s": statistics.median(copy_seconds),
               "copy_GB_per_s": results["copy_bytes"] / statistics.median(copy_seconds) / 1e9,
               "copy_outlasted_attention": statistics.median(copy_seconds) > args.steps * statistics.median(beside)}
        results[name] = row
        print(name, json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

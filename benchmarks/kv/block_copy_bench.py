"""Moving KV blocks between the GPU and the pinned host tier: torch copies vs the Triton block-copy
kernel (kvserve/kernels/triton/block_copy.py), side by side in one run, through KVTransfers (the
engine's path).

For a load and a write-back of `--blocks` blocks of a model's KV layout (default the R1-Distill-Qwen-7B
shape: 28 layers, 4 KV heads, head dim 128, bf16, 16-token blocks; 512 blocks = 8k tokens = 470 MB):
- host time to issue the copy (what the step that issues it pays on the CPU),
- GPU time until it lands, and the rate,
- the slowdown of a memory-bound stand-in for a decode step (skinny GEMMs on the main stream) while
  the copy streams in beside it.
Host ids are shuffled (a tier that has run a while hands out scattered rows) or in order.
Write-backs put their staging slots to the host by the copy engine, or (`kernel_put_by_kernel`) by the
kernel. Then the kernel's load rate for several grid caps (LINK_PROGRAMS is the engine's for a load
alone on the GPU, LINK_PROGRAMS_BESIDE_A_BATCH beside a running batch).

    python benchmarks/kv/block_copy_bench.py --json benchmarks/results/kv/h200_block_copy.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Optional

import torch


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    from kvserve.kvstore import DEVICE_STORE, HOST_STORE, LOAD, WRITE_BACK, BlockCopy, KVCacheStore, build_kv_cache_spec
    from kvserve.worker import kv_transfer
    from kvserve.worker.kv_transfer import KVTransfers

    device = torch.device("cuda")
    spec = build_kv_cache_spec(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                               model_dtype=torch.bfloat16)
    n = args.blocks
    gpu = KVCacheStore.allocate(spec, 3 * n, args.block_size, device)
    host = KVCacheStore.allocate_flat(spec, 4 * n, args.block_size, pin_memory=True, segment_blocks=n)
    gpu.write_blocks(list(range(n)), torch.randint(0, 256, (n, gpu.block_nbytes), dtype=torch.uint8))
    nbytes = n * gpu.block_nbytes
    rng = random.Random(0)
    # A memory-bound stand-in for a decode step: batch-32 GEMMs over 7B-sized weights.
    weight = torch.randn(18944, 3584, device=device, dtype=torch.bfloat16)
    activations = torch.randn(32, 3584, device=device, dtype=torch.bfloat16)

    def decode_like(iterations: int = 20) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            torch.mm(activations, weight.t())
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    results: dict = {"block_nbytes": gpu.block_nbytes, "blocks": n, "bytes": nbytes, "device": torch.cuda.get_device_name()}
    decode_like()
    results["decode_like_alone_s"] = statistics.median(decode_like() for _ in range(args.repeats))
    for name, use_kernel, put_with_kernel in (("torch", False, False), ("kernel", True, False),
                                              ("kernel_put_by_kernel", True, True)):
        kv_transfer.PUT_WITH_KERNEL = put_with_kernel
        transfers = KVTransfers({DEVICE_STORE: gpu, HOST_STORE: host}, device, use_kernel=use_kernel)
        for order in ("shuffled", "in-order"):
            host_ids = list(range(4 * n))
            if order == "shuffled":
                rng.shuffle(host_ids)
            host_ids = tuple(host_ids[:n])
            row: dict = {}
            for purpose in (WRITE_BACK, LOAD):
                issue, gpu_s, beside = [], [], []
                for repeat in range(args.repeats + 1):
                    if purpose == WRITE_BACK:
                        copy = BlockCopy(DEVICE_STORE, HOST_STORE, tuple(range(n)), host_ids, WRITE_BACK, ticket=1)
                    else:
                        copy = BlockCopy(HOST_STORE, DEVICE_STORE, host_ids, tuple(range(n, 2 * n)), LOAD, ticket=1,
                                         after_inflight=False)
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    transfers.run([copy], beside_a_batch=True)     # the decode stand-in runs beside it
                    issued = time.perf_counter() - started
                    decode_s = decode_like()          # on the main stream while the copy streams
                    torch.cuda.synchronize()
                    landed = time.perf_counter() - started
                    transfers.poll()
                    if repeat:                        # the first compiles and warms
                        issue.append(issued)
                        gpu_s.append(landed)
                        beside.append(decode_s)
                row[purpose] = {"issue_s": statistics.median(issue), "landed_s": statistics.median(gpu_s),
                                "GB_per_s": nbytes / statistics.median(gpu_s) / 1e9,
                                "decode_like_beside_s": statistics.median(beside),
                                "decode_like_slowdown": statistics.median(beside) / results["decode_like_alone_s"] - 1}
            if not torch.equal(gpu.read_blocks(list(range(n, 2 * n))), gpu.read_blocks(list(range(n)))):
                raise SystemExit("loaded blocks differ from the written ones")
            key = f"{name}_{order}"
            results[key] = row
            print(key, json.dumps(row), flush=True)
    kv_transfer.PUT_WITH_KERNEL = False
    # The kernel's load rate by grid cap.
    from kvserve.kernels.triton.block_copy import copy_block_rows
    rates = {}
    dst, src = torch.arange(n, 2 * n), torch.arange(n)
    for programs in (2, 4, 8, 16, 32, 64, 132, 264, 528):
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            started = time.perf_counter()
            copy_block_rows(gpu.pieces, dst, host.flat.live_segments(), src, host.flat.segment_blocks, to_rows=False,
                            max_programs=programs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        rates[programs] = nbytes / statistics.median(times) / 1e9
    results["kernel_load_GB_per_s_by_programs"] = rates
    results["link_programs"] = kv_transfer.LINK_PROGRAMS
    results["link_programs_beside_a_batch"] = kv_transfer.LINK_PROGRAMS_BESIDE_A_BATCH
    print("kernel load GB/s by programs", json.dumps(rates))
    # The copy engine's rate for one contiguous pinned copy of the same size: the link's ceiling here.
    staged = torch.empty(n, gpu.block_nbytes, dtype=torch.uint8, device=device)
    segment = host.flat.live_segments()[0]
    times = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        staged.copy_(segment, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    results["memcpy_h2d_GB_per_s"] = nbytes / statistics.median(times) / 1e9
    print("memcpy h2d GB/s", results["memcpy_h2d_GB_per_s"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

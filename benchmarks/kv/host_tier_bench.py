"""Block copies between the GPU KV store and a pinned host store (the host tier's transfers), next
to their bound: a plain pinned copy of the same number of bytes each way.

    python benchmarks/kv/host_tier_bench.py --model benchmarks/configs/r1-distill-qwen-7b --tokens 32768 \\
        --kv-cache-dtype auto --json out.json

The spec is the model's (its layers, KV heads, head_dim) in the chosen KV format; the blocks copied
are a contiguous run, as a request's prefix usually is not (the copy gathers by block id either way).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from kvserve.eval.timing import median_of  # noqa: E402
from kvserve.kvstore import KVCacheStore, build_kv_cache_spec  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="benchmarks/configs/r1-distill-qwen-7b", help="a folder with config.json")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    config = json.loads((pathlib.Path(args.model) / "config.json").read_text())
    heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    spec = build_kv_cache_spec(config["num_hidden_layers"], heads, head_dim, torch.bfloat16,
                               kv_cache_dtype=args.kv_cache_dtype, kv_quant_window=0, kv_quant_sinks=0)
    num_blocks = args.tokens // args.block_size
    device = torch.device("cuda")
    gpu = KVCacheStore.allocate(spec, num_blocks + 8, args.block_size, device)
    host = KVCacheStore.allocate_flat(spec, num_blocks + 8, args.block_size, pin_memory=True)
    ids = list(range(num_blocks))
    nbytes = gpu.block_nbytes * num_blocks
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    results = {"tokens": args.tokens, "kv_cache_dtype": args.kv_cache_dtype, "bytes": nbytes,
               "block_nbytes": gpu.block_nbytes, "gpu": torch.cuda.get_device_name()}
    cases = {
        "bound_to_host": lambda: pinned.copy_(flat, non_blocking=True),
        "bound_to_device": lambda: flat.copy_(pinned, non_blocking=True),
        "copy_blocks_to_host": lambda: gpu.copy_blocks(ids, ids, host),
        "copy_blocks_to_device": lambda: host.copy_blocks(ids, ids, gpu),
    }
    for name, fn in cases.items():
        seconds = median_of(fn, args.repeats, warmup=1, device=device)
        results[name] = {"seconds": seconds, "GB_per_s": nbytes / seconds / 1e9}
        print(f"{name:<24} {nbytes / 1e9:6.3f} GB  {seconds * 1e3:8.2f} ms  {nbytes / seconds / 1e9:7.1f} GB/s")
    for direction in ("to_host", "to_device"):
        results[f"fraction_of_bound_{direction}"] = (results[f"bound_{direction}"]["seconds"]
                                                     / results[f"copy_blocks_{direction}"]["seconds"])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

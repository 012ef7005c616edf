"""Launch variants of the fused-dequant decode kernel (kernels/triton/decode_attention_quant.py) on
CUDA: tile, warps, block ids loaded one iteration ahead (`ids_ahead`) and a register cap
(`max_registers`, Triton's maxnreg), per KV format, at 32k context and batch 32 with Qwen-7B
attention (the reference point). Each variant runs once to compile and take its split count from its
occupancy, then is timed as a CUDA-graph replay (see kv_quant_attention_bench.quant_attention_ms);
its output is compared with the first variant's on the same cache (max_err_vs_first).
default_quant_decode_config's choice comes from these runs.

    python benchmarks/kernels/kv_quant_variants.py --formats int8,fp8_e4m3,int4-g32 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.kernels.kv_quant_attention_bench import make_caches, quant_attention_ms  # noqa: E402
from kvserve.kernels.triton.decode_attention_quant import paged_decode_attention_quant  # noqa: E402
from kvserve.kernels.triton.decode_attention_quant_config import default_quant_decode_config  # noqa: E402

VARIANTS = [  # tile, warps, ids_ahead, max_registers (2 pipeline stages throughout)
    (64, 4, False, None), (64, 4, False, 128), (64, 4, False, 96), (64, 4, True, 128),
    (128, 4, False, None), (128, 4, True, None), (128, 4, True, 128), (128, 4, True, 96), (128, 8, True, None),
    (32, 2, True, None), (256, 4, True, None),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int8,fp8_e4m3,int4-g32")
    parser.add_argument("--context-len", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    rows = []
    for fmt in args.formats.split(","):
        spec, k_cache, v_cache, tables, lens, seq_rows, query, _ = make_caches("qwen7b", fmt, args.context_len,
                                                                                 args.batch, 16)
        base = default_quant_decode_config(query.shape[2], query.dtype)
        reference = None
        for tile, warps, ids_ahead, max_registers in VARIANTS:
            config = replace(base, tile=tile, num_warps=warps, num_stages=2, ids_ahead=ids_ahead,
                             max_registers=max_registers)
            out = paged_decode_attention_quant(query, k_cache, v_cache, tables, lens, query.shape[2] ** -0.5,
                                               seq_rows if spec.needs_rows else None, config=config)
            reference = out.float().clone() if reference is None else reference
            ms, splits = quant_attention_ms(spec, k_cache, v_cache, tables, lens, seq_rows, query, config=config)
            row = dict(format=fmt, tile=tile, warps=warps, ids_ahead=ids_ahead, max_registers=max_registers,
                       splits=splits, ms=round(ms, 4),
                       kv_gb_per_s=round(args.batch * args.context_len * spec.bytes_per_token / ms / 1e6),
                       max_err_vs_first=(out.float() - reference).abs().max().item())
            rows.append(row)
            print(json.dumps(row), flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    if args.json:
        record = {"command": "python benchmarks/kernels/kv_quant_variants.py " + " ".join(argv or sys.argv[1:]),
                  "gpu": torch.cuda.get_device_name(), "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

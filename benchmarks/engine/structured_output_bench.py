"""The cost of structured output: decode tok/s of requests constrained by a JSON schema against the
same requests unconstrained, side by side in one process, at each batch size (issue goal: <= 10%
slower at batch 32).

Each round runs the constrained batch first (greedy, a schema of eight records, so every output is
one to two hundred tokens long), then the same prompts unconstrained with each request's max_tokens
set to its constrained output's length and EOS ignored: both passes produce the same number of
tokens per request, and the ratio is of wall times. Rounds alternate and the median is reported.
Every constrained output is checked: it parses and validates against the schema. A model folder
without a tokenizer (a config for dummy weights) needs one: --tokenizer default copies the default
model's into a copy of the folder (on the GPU machine, without the default model's GGUF, a folder
prepared so beforehand is given instead).

python benchmarks/engine/structured_output_bench.py --batch-sizes 1,32 --json benchmarks/results/engine/cpu_structured_output.json
python benchmarks/engine/structured_output_bench.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \\
    --dtype bfloat16 --tokenizer default --batch-sizes 1,32 --json benchmarks/results/engine/h200_structured_output.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from kvserve.config import add_engine_args, engine_options_from_args
from kvserve.engine.engine import Engine
from kvserve.eval.bench import environment_info
from kvserve.sampling_params import SamplingParams

SCHEMA = {"type": "array", "minItems": 8, "maxItems": 8, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 12},
        "category": {"enum": ["food", "tools", "books", "toys"]},
        "in_stock": {"type": "boolean"}},
    "required": ["id", "name", "category", "in_stock"], "additionalProperties": False}}


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
         ) -> tuple[float, list[int], list[list[int]]]:
    """(seconds, output lengths, output token ids) of one batch run to completion."""
    for index, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{time.monotonic_ns()}-{index}", {"prompt_token_ids": prompt}, p)
    tokens: dict[str, list[int]] = {}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    ordered = [tokens[k] for k in sorted(tokens, key=lambda k: int(k.rsplit("-", 1)[1]))]
    return seconds, [len(t) for t in ordered], ordered


def _invalid_outputs(engine: Engine, outputs: list[list[int]]) -> list[str]:
    """The constrained outputs that do not parse as the schema's eight records (validated with
    jsonschema when it is installed): there should be none."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    invalid = []
    for ids in outputs:
        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        try:
            value = json.loads(text)
            if jsonschema is not None:
                jsonschema.validate(value, SCHEMA)
            elif not (isinstance(value, list) and len(value) == 8):
                raise ValueError("not eight records")
        except Exception as exc:     # json's ValueError, jsonschema's ValidationError
            invalid.append(f"{type(exc).__name__}: {str(exc)[:200]} in {text!r} (ids {ids})")
    return invalid


def _with_tokenizer(model: str) -> str:
    """A copy of the folder `model` with the default model's tokenizer in it."""
    from kvserve.model.loader import resolve_model
    folder = tempfile.mkdtemp(prefix="kvserve-bench-")
    for name in os.listdir(model):
        shutil.copy(os.path.join(model, name), folder)
    resolve_model(None).load_tokenizer().save_pretrained(folder)
    return folder


def measure(engine: Engine, batch: int, rounds: int, max_tokens: int) -> dict:
    tokenizer = engine.tokenizer
    prompts = [tokenizer(f"Inventory sheet {i}: list eight products of shop number {i} as JSON records.",
                         add_special_tokens=True)["input_ids"] for i in range(batch)]
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens, structured_output={"json": SCHEMA})
    _run(engine, prompts, [constrained] * batch)                  # compile, warm up
    free_times, constrained_times, tokens, checked, invalid = [], [], 0, 0, []
    for _ in range(rounds):
        seconds, lengths, outputs = _run(engine, prompts, [constrained] * batch)
        checked += len(outputs)
        invalid += _invalid_outputs(engine, outputs)
        constrained_times.append(seconds)
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        free_seconds, free_lengths, _ = _run(engine, prompts, free)
        assert free_lengths == lengths
        free_times.append(free_seconds)
        tokens = sum(lengths)
    ratios = [c / f for c, f in zip(constrained_times, free_times)]
    return {"batch_size": batch, "output_tokens": tokens, "rounds": rounds, "outputs_checked": checked,
            "outputs_invalid": len(invalid), "invalid_examples": invalid[:3],
            "constrained_tok_s": tokens / statistics.median(constrained_times),
            "unconstrained_tok_s": tokens / statistics.median(free_times),
            "slowdown_median": statistics.median(ratios) - 1, "slowdown_per_round": [r - 1 for r in ratios],
            "constrained_s": constrained_times, "unconstrained_s": free_times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-output", type=int, default=1200)
    parser.add_argument("--tokenizer", choices=("model", "default"), default="model",
                        help="default: put the default model's tokenizer into a copy of --model's folder")
    parser.add_argument("--json", default=None)
    add_engine_args(parser)
    args = parser.parse_args()
    options = engine_options_from_args(args)
    if args.tokenizer == "default":
        options["model"] = _with_tokenizer(options["model"])
    engine = Engine.from_options(**options)
    result = {"command": "python " + " ".join(sys.argv), "model": args.model or engine.source.path,
              "tokenizer": "default model's (SmolLM2, 49,152 tokens)" if args.tokenizer == "default" else "the model's",
              "vocab_size": engine.model.config.vocab_size, "dtype": str(engine.dtype), "device": str(engine.device),
              "environment": environment_info(engine.device), "schema": SCHEMA, "results": []}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        row = measure(engine, batch, args.rounds, args.max_output)
        result["results"].append(row)
        print(json.dumps({k: v for k, v in row.items()
                          if k != "invalid_examples" and (not k.endswith("_s") or k.endswith("tok_s"))}))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()

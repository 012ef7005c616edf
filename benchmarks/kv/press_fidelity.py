"""Passkey retrieval with KV presses, kvserve next to kvpress on the same model, prompts and ratios.

    python benchmarks/kv/press_fidelity.py --lengths 4000,7500 --ratios 0.5,0.25,0.125 \\
        --presses snapkv,streaming_llm,knorm,tova [--kvpress-python /path/to/venv/bin/python] --json OUT.json

The prompts (token ids) are built once (kvserve.eval.kv_fidelity.passkey_prompt: a five-digit key
at several depths of filler text) and answered greedily by
- kvserve: the default model (its GGUF, dequantized), each request carrying kv_press / kv_keep_ratio,
  prefix caching off (a shared prefix is protected from pruning, which would flatter the press);
- kvpress (benchmarks/kv/kvpress_side.py, run by `--kvpress-python`, a Python whose environment has
  kvpress and the transformers it pins): the same GGUF through transformers, the press of the same
  name at compression_ratio = 1 - keep ratio, the whole prompt pressed during prefill and decoded
  after it at the original positions (as kvserve does).
Both keep the first answer token from full attention (it comes from the prefill). SnapKV's
observation window is 64 tokens on both sides (kvpress's default; kvserve's --kv-press-window).

`--modes drop,tier` also runs kvserve's tiering mode (kv_press_mode "tier", engine/kv_tiering.py;
kvpress has none): the same press picks the blocks that stay on the GPU, the rest go to a host tier
and come back as the decode ranks them. The host tier needs prefix caching, so each prompt gets
its own cache_salt there (nothing is shared between prompts, as with caching off).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.eval.kv_fidelity import passkey_prompt  # noqa: E402
from kvserve.model.loader import default_model_path, resolve_model  # noqa: E402

WINDOW = 64


def build_prompts(tokenizer, lengths: list[int], depths: list[float], seed: int) -> list[dict]:
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        for depth in depths:
            key = rng.randrange(10000, 99999)
            prompts.append({"length": length, "depth": depth, "key": key,
                            "token_ids": passkey_prompt(tokenizer, length, depth, key)})
    return prompts


def kvserve_answers(model: str, prompts: list[dict], configs: list[tuple[str, float]], max_tokens: int,
                    threads: int) -> dict:
    import torch
    if threads:
        torch.set_num_threads(threads)
    out = {}
    with LLM(model, enable_prefix_caching=False, max_model_len=8192, kv_cache_memory=4 << 30,
             kv_press_window=WINDOW, kv_press_min_tokens=WINDOW) as llm:
        for press, ratio in configs:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                    kv_press=press if press != "full" else None,
                                    kv_keep_ratio=ratio if press != "full" else None)
            started = time.perf_counter()
            results = llm.generate([{"prompt_token_ids": p["token_ids"]} for p in prompts], params, use_tqdm=False)
            texts = [llm.engine.tokenizer.decode(r.outputs[0].token_ids) for r in results]
            out[f"{press}@{ratio}"] = {"answers": texts, "seconds": round(time.perf_counter() - started, 1)}
            print(f"kvserve {press}@{ratio}: {score(prompts, texts):.2f} in {out[f'{press}@{ratio}']['seconds']} s",
                  flush=True)
    return out


def kvserve_tier_answers(model: str, prompts: list[dict], configs: list[tuple[str, float]], max_tokens: int,
                         threads: int, interval: int) -> dict:
    import torch
    if threads:
        torch.set_num_threads(threads)
    out = {}
    with LLM(model, max_model_len=8192, kv_cache_memory=4 << 30, kv_host_memory=4 << 30, kv_press_window=WINDOW,
             kv_press_min_tokens=WINDOW, kv_tier_interval=interval) as llm:
        engine = llm.engine
        for press, ratio in configs:
            if press == "full":
                continue
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, kv_press=press,
                                    kv_keep_ratio=ratio, kv_press_mode="tier")
            started = time.perf_counter()
            for index, prompt in enumerate(prompts):
                engine.add_request(str(index), {"prompt_token_ids": prompt["token_ids"]}, params, cache_salt=str(index))
            done = {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        done[output.request_id] = output.outputs[0].token_ids
            texts = [engine.tokenizer.decode(done[str(index)]) for index in range(len(prompts))]
            name = f"tier:{press}@{ratio}"
            out[name] = {"answers": texts, "seconds": round(time.perf_counter() - started, 1)}
            print(f"kvserve {name}: {score(prompts, texts):.2f} in {out[name]['seconds']} s", flush=True)
        out["press_stats"] = [vars(stats) for stats in engine.make_stats().presses]
    return out


def score(prompts: list[dict], answers: list[str]) -> float:
    return sum(str(p["key"]) in a.replace(" ", "") for p, a in zip(prompts, answers)) / len(prompts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model's GGUF")
    parser.add_argument("--lengths", default="4000,7500")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--ratios", default="0.5,0.25,0.125", help="keep ratios")
    parser.add_argument("--presses", default="snapkv,streaming_llm,knorm,tova")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--kvpress-python", default=None, help="a Python with kvpress installed (else kvpress is skipped)")
    parser.add_argument("--skip-kvserve", action="store_true")
    parser.add_argument("--modes", default="drop", help="kvserve's press modes: drop, tier or both (drop,tier)")
    parser.add_argument("--tier-interval", type=int, default=1, help="tier mode: --kv-tier-interval")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    model = args.model or default_model_path()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    configs = [("full", 1.0)] + [(p, r) for p in args.presses.split(",") for r in ratios]
    tokenizer = resolve_model(model).load_tokenizer()
    prompts = build_prompts(tokenizer, lengths, depths, args.seed)
    results: dict = {"command": "python " + " ".join(sys.argv), "model": model, "window": WINDOW,
                     "prompts": [{k: v for k, v in p.items() if k != "token_ids"} | {"tokens": len(p["token_ids"])}
                                 for p in prompts], "kvserve": {}, "kvpress": {}}
    modes = args.modes.split(",")
    if not args.skip_kvserve and "drop" in modes:
        results["kvserve"] = kvserve_answers(model, prompts, configs, args.max_tokens, args.threads)
    elif not args.skip_kvserve:
        results["kvserve"] = kvserve_answers(model, prompts, configs[:1], args.max_tokens, args.threads)
    if not args.skip_kvserve and "tier" in modes:
        tier = kvserve_tier_answers(model, prompts, configs, args.max_tokens, args.threads, args.tier_interval)
        results["kvserve_press_stats"] = tier.pop("press_stats")
        results["kvserve"].update(tier)
        results["tier_interval"] = args.tier_interval
    if args.kvpress_python:
        with tempfile.TemporaryDirectory() as work:
            spec = os.path.join(work, "spec.json")
            answers = os.path.join(work, "answers.json")
            with open(spec, "w") as f:
                json.dump({"model": model, "prompts": [p["token_ids"] for p in prompts], "configs": configs,
                           "max_tokens": args.max_tokens, "window": WINDOW, "threads": args.threads}, f)
            subprocess.run([args.kvpress_python, os.path.join(REPO, "benchmarks", "kv", "kvpress_side.py"), spec,
                            answers], check=True)
            with open(answers) as f:
                side = json.load(f)
        results["kvpress_versions"] = side.pop("versions")
        for name, entry in side.items():
            entry["answers"] = [tokenizer.decode(ids) for ids in entry.pop("token_ids")]
            results["kvpress"][name] = entry
    table = {}
    for system in ("kvserve", "kvpress"):
        for name, entry in results[system].items():
            entry["accuracy"] = score(prompts, entry["answers"])
            table.setdefault(name, {})[system] = entry["accuracy"]
    results["accuracy"] = table
    print(f"{'press@keep':<22} {'kvserve':>8} {'kvpress':>8}")
    for name, row in table.items():
        print(f"{name:<22} {row.get('kvserve', float('nan')):8.2f} {row.get('kvpress', float('nan')):8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

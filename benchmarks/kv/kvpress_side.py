"""kvpress's side of benchmarks/kv/press_fidelity.py, run by a Python whose environment has kvpress
(and the transformers version it pins, which may differ from kvserve's).

    PYTHON benchmarks/kv/kvpress_side.py SPEC.json ANSWERS.json

SPEC: {"model": GGUF path, "prompts": [token ids], "configs": [[press, keep ratio]], "max_tokens",
"window", "threads"}. For each config and prompt: the GGUF's model through transformers (fp32),
the whole prompt prefilled under the press (compression_ratio = 1 - keep), then greedy decoding at
the original positions over the pressed cache. ANSWERS: {"press@keep": {"token_ids": [...],
"seconds"}, "versions": {...}}.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def make_press(name: str, keep: float, window: int):
    import kvpress
    ratio = 1.0 - keep
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=window)
    if name == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio)
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if name == "tova":
        return kvpress.TOVAPress(compression_ratio=ratio)
    return NotImplemented                # kvserve's own (h2o needs eager attention there; similarity_merge is ours)


def greedy(model, prompt: list[int], press, max_tokens: int) -> list[int]:
    from transformers import DynamicCache
    ids = torch.tensor([prompt])
    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            out = model(ids, past_key_values=cache, use_cache=True)
        else:
            with press(model):
                out = model(ids, past_key_values=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        tokens = [token]
        for step in range(max_tokens - 1):
            position = len(prompt) + step
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[position]]),
                        cache_position=torch.tensor([cache.get_seq_length()]))
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
    return tokens


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM
    path = spec["model"]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    out = {"versions": {"kvpress": getattr(kvpress, "__version__", "?"), "transformers": transformers.__version__,
                        "torch": torch.__version__}}
    for press_name, keep in spec["configs"]:
        press = None if press_name == "full" else make_press(press_name, keep, spec["window"])
        if press is NotImplemented:
            continue
        started = time.perf_counter()
        answers = [greedy(model, prompt, press, spec["max_tokens"]) for prompt in spec["prompts"]]
        out[f"{press_name}@{keep}"] = {"token_ids": answers, "seconds": round(time.perf_counter() - started, 1)}
        print(f"kvpress {press_name}@{keep}: {out[f'{press_name}@{keep}']['seconds']} s", flush=True)
        with open(out_path, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

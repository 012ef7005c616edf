"""Prefix-cache benchmark: hit rate per eviction policy next to Belady's MIN, and TTFT with and
without prefix caching through the real engine.

Part 1 (hit rates, no model): synthetic traces, generated here from a seed, are replayed request by
request through the engine's own `KVCacheManager` + `PrefixCache` (the code the scheduler calls:
`find_cached_prefix`, `allocate_slots`, `cache_full_blocks`, `free`) on a simulated clock, for each
eviction policy and several cache sizes. The offline optimum replays the same trace with the same
block accounting (a request holds all its blocks while it runs; only full computed blocks are
cached; the last prompt token is always recomputed) but evicts the cached block whose next use is
farthest in the future (Belady's MIN; ties deeper-first). A second offline yardstick is lru that
also knows which blocks no later request looks up and evicts those first: what knowing *that* a
conversation has ended is worth, without knowing *when* the others come back (below MIN, but not
above every online policy: it has no notion of frequency). A third is lru that knows from the whole
trace which blocks are shared prefixes (at or above a branch of the chain tree: system prompts) and
evicts them last: what learning the shared prefixes perfectly, with recency for the rest, is worth.

Traces (token ids are random, so only deliberate repeats share blocks):
- `system`: shared system prompts of 300-1500 tokens with Zipf(1.0) popularity, each request the
  system prompt + a unique question + an answer;
- `chat`: users with Zipf(1.0) activity send turns of their current conversation, each turn's
  prompt the whole history (a Zipf-chosen system prompt, earlier questions and answers) + a new
  question; a conversation ends with probability 0.2 per turn;
- `chat-sessions`: conversations arrive as a Poisson process and run 1-12 turns separated by
  exponential think times (memoryless: recency is all an online policy can go by);
- `mixed`: Zipf system-prompt traffic whose popularity ranking is reshuffled halfway (drift),
  interleaved with one-off long documents (a scan) and a few multi-turn chats.

Part 2 (TTFT): a multi-turn chat through `Engine` on the default model (CPU), with and without
prefix caching: the same conversations (a shared system prompt, turns interleaved across
conversations, one request at a time so TTFT is the prompt's own prefill).

    python benchmarks/prefix_bench.py                       # both parts, JSON to benchmarks/results/
    python benchmarks/prefix_bench.py --quick --no-ttft     # a smaller hit-rate run
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvserve.kvcache.policies import LRUPolicy, make_policy  # noqa: E402
from kvserve.kvcache.manager import KVCacheManager, blocks_for_tokens  # noqa: E402
from kvserve.kvcache.prefix_cache import PrefixCache, chain_hashes, namespace_root  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 50_000
POLICIES = ("lru", "lru-k", "lfu-age", "fanout", "adaptive")
FIXED_POLICIES = tuple(p for p in POLICIES if p != "adaptive")


# --------------------------------------------------------------------------------------------------
# traces
# --------------------------------------------------------------------------------------------------

@dataclass
class TraceRequest:
    time: float
    prompt: list[int]
    output: list[int]
    namespace: str = ""


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


class Zipf:
    """Ranks 0..n-1 with P(rank r) proportional to 1 / (r + 1)^alpha."""

    def __init__(self, n: int, alpha: float) -> None:
        weights = [1.0 / (r + 1) ** alpha for r in range(n)]
        total = sum(weights)
        self.cdf = list(itertools.accumulate(w / total for w in weights))

    def sample(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self.cdf, rng.random()), len(self.cdf) - 1)


def system_trace(seed: int, num_requests: int, num_prompts: int = 60, alpha: float = 1.0,
                 rate: float = 2.0) -> list[TraceRequest]:
    rng = random.Random(seed)
    prompts = [_tokens(rng, rng.randint(300, 1500)) for _ in range(num_prompts)]
    zipf = Zipf(num_prompts, alpha)
    now, trace = 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        system = prompts[zipf.sample(rng)]
        trace.append(TraceRequest(now, system + _tokens(rng, rng.randint(20, 200)), _tokens(rng, rng.randint(20, 200))))
    return trace


def _conversation(rng: random.Random, start: float, system: list[int], max_turns: int,
                  think_s: float) -> list[TraceRequest]:
    turns = min(max_turns, 1 + int(rng.expovariate(1 / 3.0)))
    history, now, out = list(system), start, []
    for _ in range(turns):
        question, answer = _tokens(rng, rng.randint(20, 120)), _tokens(rng, rng.randint(30, 250))
        prompt = history + question
        out.append(TraceRequest(now, prompt, answer))
        history = prompt + answer
        now += 5.0 + rng.expovariate(1 / think_s)
    return out


def chat_trace(seed: int, num_requests: int, num_users: int = 300, alpha: float = 1.0, rate: float = 1.0,
               num_systems: int = 8, end_probability: float = 0.2, max_history: int = 6000) -> list[TraceRequest]:
    """Users with Zipf(alpha) activity send turns of their current conversation; after each turn
    the conversation ends with `end_probability` (or when its history passes `max_history`) and
    the user's next request opens a new one on a Zipf-chosen system prompt."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(100, 600)) for _ in range(num_systems)]
    system_zipf, user_zipf = Zipf(num_systems, 1.1), Zipf(num_users, alpha)
    histories: dict[int, list[int]] = {}
    now, trace = 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        user = user_zipf.sample(rng)
        history = histories.get(user) or list(systems[system_zipf.sample(rng)])
        prompt = history + _tokens(rng, rng.randint(20, 120))
        answer = _tokens(rng, rng.randint(30, 250))
        trace.append(TraceRequest(now, prompt, answer))
        history = prompt + answer
        ended = rng.random() < end_probability or len(history) > max_history
        histories[user] = [] if ended else history
    return trace


def chat_sessions_trace(seed: int, num_requests: int, num_systems: int = 10, alpha: float = 1.1,
                        rate: float = 0.6, think_s: float = 45.0) -> list[TraceRequest]:
    """Conversations arrive as a Poisson process; each runs 1-12 turns separated by exponential
    think times (memoryless: recency is all an online policy can go by)."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(100, 600)) for _ in range(num_systems)]
    zipf = Zipf(num_systems, alpha)
    trace: list[TraceRequest] = []
    start = 0.0
    while len(trace) < num_requests:
        start += rng.expovariate(rate)
        trace += _conversation(rng, start, systems[zipf.sample(rng)], 12, think_s)
    trace.sort(key=lambda r: r.time)
    return trace[:num_requests]


def mixed_trace(seed: int, num_requests: int, num_prompts: int = 60, alpha: float = 1.0,
                rate: float = 2.0) -> list[TraceRequest]:
    rng = random.Random(seed)
    prompts = [_tokens(rng, rng.randint(300, 1200)) for _ in range(num_prompts)]
    zipf = Zipf(num_prompts, alpha)
    ranking = list(range(num_prompts))
    trace: list[TraceRequest] = []
    now = 0.0
    for index in range(num_requests):
        now += rng.expovariate(rate)
        if index == num_requests // 2:
            rng.shuffle(ranking)          # popularity drift: yesterday's favourites go cold
        kind = rng.random()
        if kind < 0.25:                   # a one-off long document (scan)
            trace.append(TraceRequest(now, _tokens(rng, rng.randint(800, 2500)), _tokens(rng, rng.randint(20, 100))))
        elif kind < 0.30:                 # a short chat
            trace += _conversation(rng, now, prompts[ranking[zipf.sample(rng)]], 4, 20.0)
        else:
            system = prompts[ranking[zipf.sample(rng)]]
            trace.append(TraceRequest(now, system + _tokens(rng, rng.randint(20, 200)),
                                      _tokens(rng, rng.randint(20, 150))))
    trace.sort(key=lambda r: r.time)
    return trace[:num_requests]


TRACES = {"system": system_trace, "chat": chat_trace, "chat-sessions": chat_sessions_trace, "mixed": mixed_trace}


def unique_blocks(trace: list[TraceRequest]) -> int:
    seen: set[bytes] = set()
    for request in trace:
        seen.update(chain_hashes(namespace_root(request.namespace), request.prompt + request.output[:-1], BLOCK_SIZE))
    return len(seen)


# --------------------------------------------------------------------------------------------------
# replay through the engine's KV manager
# --------------------------------------------------------------------------------------------------

@dataclass
class SimSequence:
    """What the KV manager needs of a request (engine.request.Request's prefix-cache surface)."""
    request_id: str
    tokens: list[int]
    cache_namespace: str = ""
    block_hashes: list[bytes] = field(default_factory=list)
    cache_root: bytes = b""

    def __post_init__(self) -> None:
        self.cache_root = namespace_root(self.cache_namespace)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _replay(trace: list[TraceRequest], capacity_blocks: int, cache: PrefixCache, clock: SimClock,
            on_request: Optional[Callable[[int], None]] = None) -> float:
    """Token hit rate of the trace replayed request by request through the KV manager and `cache`."""
    manager = KVCacheManager(capacity_blocks, BLOCK_SIZE, cache)
    query = hit = 0
    for index, request in enumerate(trace):
        clock.now = request.time
        if on_request is not None:
            on_request(index)
        rid = str(index)
        seq = SimSequence(rid, list(request.prompt), request.namespace)
        prefix = manager.find_cached_prefix(seq)
        ok = manager.allocate_slots(rid, len(seq.tokens), prefix, seq)
        assert ok, "the cache is smaller than one request"
        query += len(request.prompt)
        hit += prefix.num_tokens
        manager.cache_full_blocks(rid, len(seq.tokens))
        # Decode: every generated token but the last is fed back, so its KV is computed.
        seq.tokens += request.output
        assert manager.allocate_slots(rid, len(seq.tokens))
        manager.cache_full_blocks(rid, len(seq.tokens) - 1)
        manager.free(rid)
    assert manager.num_free_blocks == capacity_blocks
    return hit / query


def simulate_policy(trace: list[TraceRequest], capacity_blocks: int, policy_name: str,
                    lru_k: int = 2, half_life_s: float = 120.0) -> dict:
    clock = SimClock()
    policy = make_policy(policy_name, lru_k=lru_k, half_life_s=half_life_s, num_blocks=capacity_blocks)
    # Retained histories as the engine keeps them (build_prefix_cache): 2x the pool's blocks.
    cache = PrefixCache(policy, clock, history_blocks=2 * capacity_blocks)
    result = {"hit_rate": _replay(trace, capacity_blocks, cache, clock), "evictions": dict(cache.evictions)}
    if policy_name == "adaptive":
        snap = policy.snapshot()
        result["adaptive"] = {"final_arm": snap.active, "num_switches": snap.num_switches,
                              "shadow_hit_rates": {k: round(v, 4) for k, v in snap.shadow_hit_rates.items()},
                              "recent_decisions": list(snap.recent_decisions)}
    return result


NextUse = Callable[[bytes, int], float]


def _future_lookups(trace: list[TraceRequest]) -> tuple[list[list[bytes]], list[list[bytes]], NextUse]:
    """Per request, the hashes of its full computed blocks and of the blocks its lookup may hit,
    and next_use(hash, after): the index of the next request after `after` that looks it up."""
    bs = BLOCK_SIZE
    lookups, chains = [], []
    for request in trace:
        full = chain_hashes(namespace_root(request.namespace), request.prompt + request.output[:-1], bs)
        chains.append(full)
        lookups.append(full[:(len(request.prompt) - 1) // bs])
    uses: dict[bytes, list[int]] = {}          # hash -> indices of the requests that look it up
    for index, chain in enumerate(lookups):
        for h in chain:
            uses.setdefault(h, []).append(index)

    def next_use(h: bytes, after: int) -> float:
        seq = uses.get(h, ())
        i = bisect.bisect_right(seq, after)
        return seq[i] if i < len(seq) else math.inf

    return chains, lookups, next_use


class _DeadFirstCache(PrefixCache):
    """LRU that also knows which released blocks no later request will look up, and evicts those
    first. Not a policy (it reads the future): it measures what knowing *that* a conversation
    has ended is worth, leaving to Belady only the foresight of *when* the others come back."""

    def __init__(self, clock: SimClock, next_use: NextUse, capacity_blocks: int) -> None:
        super().__init__(LRUPolicy(), clock, history_blocks=2 * capacity_blocks)
        self._next_use = next_use
        self.request_index = 0

    def on_release(self, block_id: int) -> None:
        cached = self._by_block[block_id]
        dead = self._next_use(cached.block_hash, self.request_index) == math.inf
        self._evictor.add(block_id, -math.inf if dead else cached.stats.times[-1], cached.stats.depth)


def simulate_dead_first_lru(trace: list[TraceRequest], capacity_blocks: int) -> float:
    _, _, next_use = _future_lookups(trace)
    clock = SimClock()
    cache = _DeadFirstCache(clock, next_use, capacity_blocks)
    return _replay(trace, capacity_blocks, cache, clock,
                   on_request=lambda index: setattr(cache, "request_index", index))


def shared_prefix_blocks(trace: list[TraceRequest]) -> set[bytes]:
    """The blocks of the trace's shared prefixes: every block at or above a branch of the chain
    tree (a block with two or more distinct children over the whole trace), e.g. system prompts."""
    children: dict[bytes, set[bytes]] = {}
    parent: dict[bytes, bytes] = {}
    for chain in _future_lookups(trace)[0]:
        for above, below in zip(chain, chain[1:]):
            children.setdefault(above, set()).add(below)
            parent[below] = above
    shared: set[bytes] = set()
    for branch in (h for h, kids in children.items() if len(kids) > 1):
        h: Optional[bytes] = branch
        while h is not None and h not in shared:
            shared.add(h)
            h = parent.get(h)
    return shared


class _SharedLastCache(PrefixCache):
    """LRU that knows, from the whole trace, which blocks are shared prefixes (see
    shared_prefix_blocks) and evicts them only when nothing else is left. On a trace whose
    conversations come back after memoryless think times, recency orders the conversations as
    well as anything observable can, so this is what an online policy could reach by learning
    the shared prefixes perfectly: a yardstick, not a bound (it has no frequency)."""

    def __init__(self, clock: SimClock, shared: set[bytes], capacity_blocks: int) -> None:
        super().__init__(LRUPolicy(), clock, history_blocks=2 * capacity_blocks)
        self._shared = shared

    def on_release(self, block_id: int) -> None:
        cached = self._by_block[block_id]
        # The evictor's pinned tier goes only when nothing else is left.
        self._evictor.add(block_id, cached.stats.times[-1], cached.stats.depth, cached.block_hash in self._shared)


def simulate_shared_last_lru(trace: list[TraceRequest], capacity_blocks: int,
                             shared: Optional[set[bytes]] = None) -> float:
    """`shared`: shared_prefix_blocks(trace), when the caller replays several cache sizes."""
    clock = SimClock()
    shared = shared_prefix_blocks(trace) if shared is None else shared
    return _replay(trace, capacity_blocks, _SharedLastCache(clock, shared, capacity_blocks), clock)


def simulate_belady(trace: list[TraceRequest], capacity_blocks: int) -> float:
    """Belady's MIN under the same block accounting as the replay above: when a request needs
    blocks, the cached blocks it does not hold whose next use is farthest away go first."""
    bs = BLOCK_SIZE
    chains, lookups, next_use = _future_lookups(trace)
    cached: dict[bytes, float] = {}            # resident hash -> next use it was queued with
    heap: list[tuple[float, int, int, bytes]] = []   # (-next use, -depth, tie, hash); stale entries skipped
    tie = itertools.count()
    query = hit = 0
    for index, request in enumerate(trace):
        lookup = lookups[index]
        hits = 0
        for h in lookup:
            if h not in cached:
                break
            hits += 1
        query += len(request.prompt)
        hit += hits * bs
        held = set(lookup[:hits])
        needed = blocks_for_tokens(len(request.prompt) + len(request.output), bs) - hits
        aside = []
        while len(cached) + needed > capacity_blocks:
            entry = heapq.heappop(heap)
            h = entry[3]
            if cached.get(h) != -entry[0]:
                continue                        # stale
            if h in held:
                aside.append(entry)
                continue
            del cached[h]
        for entry in aside:
            heapq.heappush(heap, entry)
        # The request's full computed blocks stay cached, each queued with its next use.
        for depth, h in enumerate(chains[index]):
            nu = next_use(h, index)
            cached[h] = nu
            heapq.heappush(heap, (-nu, -depth, next(tie), h))
        assert len(cached) <= capacity_blocks
    return hit / query


# --------------------------------------------------------------------------------------------------
# TTFT through the engine
# --------------------------------------------------------------------------------------------------

def ttft_run(enable_prefix_caching: bool, conversations: int, turns: int, max_tokens: int,
             system_words: int, seed: int) -> dict:
    from kvserve.sampling_params import SamplingParams
    from kvserve.llm import LLM
    llm = LLM(None, dtype="float32", device="cpu", kv_cache_memory=256 << 20,
              enable_prefix_caching=enable_prefix_caching)
    engine = llm.engine
    rng = random.Random(seed)
    words = ("cache memory block token prefix request model engine policy tenant latency batch "
             "kernel tensor layer attention query key value eviction pin system prompt turn").split()
    system = "You are a careful assistant for a storage company. " + " ".join(
        rng.choice(words) for _ in range(system_words))
    histories = [[{"role": "system", "content": system}] for _ in range(conversations)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    records = []
    for turn in range(turns):
        for conv, history in enumerate(histories):
            question = f"Question {turn} from user {conv}: explain " + " ".join(rng.choice(words) for _ in range(12))
            history.append({"role": "user", "content": question})
            prompt_ids = llm.apply_chat_template(history)
            start = time.perf_counter()
            request_id = engine.add_request(None, {"prompt_token_ids": prompt_ids}, params)
            first = None
            final = None
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    if first is None and output.outputs[0].token_ids:
                        first = time.perf_counter() - start
                    if output.finished:
                        final = output
            history.append({"role": "assistant", "content": final.outputs[0].text})
            records.append({"turn": turn, "conversation": conv, "prompt_tokens": len(prompt_ids),
                            "ttft_s": round(first, 4), "output_tokens": final.outputs[0].token_ids})
    stats = engine.prefix.stats
    return {"enable_prefix_caching": enable_prefix_caching, "records": records,
            "hit_rate": round(stats.hit_rate, 4) if enable_prefix_caching else 0.0,
            "mean_ttft_s": round(statistics.mean(r["ttft_s"] for r in records), 4),
            "median_ttft_s": round(statistics.median(r["ttft_s"] for r in records), 4),
            "mean_ttft_after_first_turn_s": round(statistics.mean(r["ttft_s"] for r in records if r["turn"] > 0), 4),
            "prompt_tokens_total": sum(r["prompt_tokens"] for r in records)}


# --------------------------------------------------------------------------------------------------

def _machine() -> dict:
    import torch
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count()}


def run_hit_rates(args) -> dict:
    results = {"command": "python benchmarks/prefix_bench.py " + " ".join(sys.argv[1:]), "block_size": BLOCK_SIZE,
               "machine": _machine(), "lru_k": args.lru_k, "heat_half_life_s": args.half_life, "traces": {}}
    for name in args.traces:
        trace = TRACES[name](args.seed, args.requests)
        working_set = unique_blocks(trace)
        largest = max(blocks_for_tokens(len(r.prompt) + len(r.output), BLOCK_SIZE) for r in trace)
        sizes = sorted({max(largest + 1, int(working_set * f)) for f in args.fractions})
        shared = shared_prefix_blocks(trace) if args.oracle_bounds else set()
        entry = {"num_requests": len(trace), "prompt_tokens": sum(len(r.prompt) for r in trace),
                 "unique_blocks": working_set, "duration_s": round(trace[-1].time - trace[0].time, 1), "sizes": []}
        for size in sizes:
            row = {"capacity_blocks": size, "capacity_tokens": size * BLOCK_SIZE,
                   "fraction_of_unique_blocks": round(size / working_set, 3), "hit_rate": {}}
            for policy in POLICIES:
                started = time.perf_counter()
                sim = simulate_policy(trace, size, policy, args.lru_k, args.half_life)
                row["hit_rate"][policy] = round(sim["hit_rate"], 4)
                row.setdefault("evictions", {})[policy] = sim["evictions"]
                row.setdefault("replay_s", {})[policy] = round(time.perf_counter() - started, 2)
                if "adaptive" in sim:
                    row["adaptive"] = sim["adaptive"]
            row["hit_rate"]["belady"] = round(simulate_belady(trace, size), 4)
            if args.oracle_bounds:
                row["oracle_bounds"] = {
                    "lru_evicting_never_reused_first": round(simulate_dead_first_lru(trace, size), 4),
                    "lru_keeping_shared_prefixes": round(simulate_shared_last_lru(trace, size, shared), 4)}
            fixed = {p: row["hit_rate"][p] for p in FIXED_POLICIES}
            best = max(fixed, key=fixed.get)
            row["best_fixed"] = best
            row["adaptive_minus_best_fixed"] = round(row["hit_rate"]["adaptive"] - fixed[best], 4)
            row["belady_minus_adaptive"] = round(row["hit_rate"]["belady"] - row["hit_rate"]["adaptive"], 4)
            entry["sizes"].append(row)
            print(f"{name:7s} {size:6d} blocks ({row['fraction_of_unique_blocks']:.2f} of working set): "
                  + "  ".join(f"{p} {v:.3f}" for p, v in {**row["hit_rate"], **row.get("oracle_bounds", {})}.items()),
                  flush=True)
        results["traces"][name] = entry
    gaps = [row["adaptive_minus_best_fixed"] for t in results["traces"].values() for row in t["sizes"]]
    to_min = [row["belady_minus_adaptive"] for t in results["traces"].values() for row in t["sizes"]]
    results["summary"] = {"worst_adaptive_minus_best_fixed": min(gaps), "worst_belady_minus_adaptive": max(to_min),
                          "goal_within_5_points_of_best_fixed": min(gaps) >= -0.05,
                          "goal_within_15_points_of_belady": max(to_min) <= 0.15}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default="system,chat,chat-sessions,mixed")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--fractions", default="0.01,0.02,0.05,0.1",
                        help="cache sizes as fractions of the trace's distinct blocks")
    parser.add_argument("--lru-k", type=int, default=2)
    parser.add_argument("--half-life", type=float, default=120.0, help="lru-k heat half-life, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1000 requests per trace")
    parser.add_argument("--ttft", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure TTFT through the engine on the default model")
    parser.add_argument("--hit-rates", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--oracle-bounds", action=argparse.BooleanOptionalAction, default=True,
                        help="also replay the offline yardsticks for the gap to Belady: lru knowing which blocks "
                             "are never looked up again, and lru keeping the trace's shared prefixes")
    parser.add_argument("--ttft-conversations", type=int, default=3)
    parser.add_argument("--ttft-turns", type=int, default=4)
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    args.traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    args.fractions = [float(f) for f in args.fractions.split(",")]
    if args.quick:
        args.requests = 1000
    os.makedirs(args.out_dir, exist_ok=True)
    if args.hit_rates:
        results = run_hit_rates(args)
        path = os.path.join(args.out_dir, "prefix_hit_rates.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps(results["summary"]), "->", path)
    if args.ttft:
        runs = [ttft_run(flag, args.ttft_conversations, args.ttft_turns, 24, 300, args.seed) for flag in (False, True)]
        same = [r["output_tokens"] for r in runs[0]["records"]] == [r["output_tokens"] for r in runs[1]["records"]]
        ttft = {"command": "python benchmarks/prefix_bench.py " + " ".join(sys.argv[1:]), "machine": _machine(),
                "model": "SmolLM2-135M-Instruct (default, GGUF Q4_1 dequantized to fp32), CPU",
                "conversations": args.ttft_conversations, "turns": args.ttft_turns,
                "outputs_identical_with_and_without_caching": same, "runs": runs,
                "speedup_mean_ttft": round(runs[0]["mean_ttft_s"] / runs[1]["mean_ttft_s"], 2)}
        path = os.path.join(args.out_dir, "prefix_ttft.json")
        with open(path, "w") as f:
            json.dump(ttft, f, indent=1)
        print(f"TTFT mean {runs[0]['mean_ttft_s']:.3f}s without, {runs[1]['mean_ttft_s']:.3f}s with prefix caching "
              f"(hit rate {runs[1]['hit_rate']:.3f}); outputs identical: {same} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

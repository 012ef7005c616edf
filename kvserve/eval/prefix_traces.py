"""Synthetic prefix-cache traces (benchmarks/kv/prefix_bench.py replays them; tests use them too).

Token ids are random, so only deliberate repeats share blocks:
- `system`: shared system prompts of 300-1500 tokens with Zipf(1.0) popularity, each request the
  system prompt + a unique question + an answer;
- `chat`: users with Zipf(1.0) activity send turns of their current conversation, each turn's
  prompt the whole history (a Zipf-chosen system prompt, earlier questions and answers) + a new
  question; a conversation ends with probability 0.2 per turn;
- `chat-sessions`: conversations arrive as a Poisson process and run 1-12 turns separated by
  exponential think times (memoryless: recency is all an online policy can go by);
- `mixed`: Zipf system-prompt traffic whose popularity ranking is reshuffled halfway (drift),
  interleaved with one-off long documents (a scan) and a few multi-turn chats.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass

from kvserve.kvcache.prefix_cache import chain_hashes, namespace_root

BLOCK_SIZE = 16
VOCAB = 50_000


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

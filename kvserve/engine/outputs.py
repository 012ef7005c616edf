"""Results in the shape vLLM users know: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str] = None     # "stop", "length", "abort" or None while running
    stop_reason: Optional[int | str] = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    finished_time: Optional[float]
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: Optional[RequestMetrics] = None
    # Prompt tokens whose KV came from the prefix cache or a KV tier (vLLM's name; the first
    # sample's, which the others share): OpenAI's usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: Optional[int] = None
    # A traced request's phases (queued, KV loads, prefill chunks, decode and its sampled steps,
    # preemptions; kvserve/sched/phases.py), once, in its finished output; the server's tracer
    # turns them into spans. None: not traced.
    phases: Optional[list] = None

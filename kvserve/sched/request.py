"""State of one request as the scheduler sees it (the scheduler owns these objects)."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from kvserve.sampling_params import SamplingParams
from kvserve.kvcache.prefix_cache import make_namespace, namespace_root
from kvserve.sched.phases import RequestPhases

_DEFAULT_NAMESPACE = make_namespace(None, None)
_DEFAULT_ROOT = namespace_root(_DEFAULT_NAMESPACE)


# Stands in output_token_ids for a token sampled on the device but not yet read back (overlapped
# scheduling, kvserve/engine/engine.py). Never a valid token id.
PENDING_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"     # shed before it started: it could not meet its TTFT target

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_REJECTED)


class PressPlanLike(Protocol):
    """What the request needs of its press plan (engine/press_control.py's PressPlan owns the rest)."""

    def reset(self, request: "Request") -> None: ...


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                      # resolved (params.max_tokens or what max_model_len leaves)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0                    # --scheduling-policy priority: lower first (sched/priority.py)
    aging_grace_s: float = 0.0           # seconds before its priority starts to age (its class's)
    qos_class: Optional[str] = None      # its request class (--qos-config; sched/qos_classes.py)
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache. Invariant: < num_tokens while the request waits for a
    # token, so the last token is always recomputed to produce logits.
    num_computed_tokens: int = 0
    # KV compression (kvserve/press; engine/press_control.py): tokens a press removed from the KV.
    # Positions stay the original ones (the next token is at num_computed_tokens) while the KV is
    # num_kv_tokens long. publish_limit: tokens whose blocks may enter the prefix cache (None: all
    # computed ones); a request with a press publishes only the blocks the press left intact.
    num_pruned_tokens: int = 0
    publish_limit: Optional[int] = None
    # Where a prefill chunk must stop until the press has run (its prompt's end): a request that
    # recomputes after preemption is pressed at the same point as the first time, and its outputs
    # are then recomputed over the pressed KV, as they were first computed.
    press_stop: Optional[int] = None
    press: Optional["PressPlanLike"] = None    # its PressPlan (engine/press_control.py), or None
    # Teacher forcing, internal (Engine.add_request's forced_token_ids; no API field): output i is
    # forced_token_ids[i] whatever the logits say, and its logprob is recorded (kvserve/eval).
    forced_token_ids: Optional[list[int]] = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Optional[int | str] = None
    generator: Optional[torch.Generator] = None
    num_preemptions: int = 0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    # Per generated token: {token_id: logprob} when params.logprobs is set; one per prompt token
    # (the first is None) when params.prompt_logprobs is set.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # The sum of the sampled tokens' logprobs, kept as they arrive: summing the list for every
    # step's output costs the engine core O(length) Python work per request per step.
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[Optional[dict[int, float]]] = field(default_factory=list)
    # Prefix caching: the namespace its blocks are cached in (tenant or share group, + cache_salt),
    # that namespace's root hash, and the chain hashes of its full blocks (extended by the KV
    # manager as blocks fill; a pure function of the tokens, so they survive preemption).
    tenant: Optional[str] = None
    cache_namespace: str = _DEFAULT_NAMESPACE
    cache_root: bytes = _DEFAULT_ROOT
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: Optional[int] = None     # tokens served from the prefix cache at first admission
    expected_cached_tokens: int = 0             # cached when it arrived: latency estimates (slo.py) only
    num_bypassed: int = 0                       # times a later request was admitted first (cache-aware order)
    phases: Optional[RequestPhases] = None      # traced requests only: its phases (sched/phases.py)

    def set_cache_namespace(self, namespace: str) -> None:
        self.cache_namespace = namespace
        self.cache_root = namespace_root(namespace)
        self.block_hashes.clear()

    @property
    def uses_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed, so such requests skip lookups
        (their blocks are still published for others)."""
        return self.params.prompt_logprobs is None

    @property
    def num_kv_tokens(self) -> int:
        """Tokens in its KV cache: the computed ones less those a press removed (also the KV index
        of the next token computed)."""
        return self.num_computed_tokens - self.num_pruned_tokens

    @property
    def num_publishable_tokens(self) -> int:
        if self.publish_limit is None:
            return self.num_computed_tokens
        return min(self.num_computed_tokens, self.publish_limit)

    def tokens_to_compute(self, num_computed: int) -> int:
        """Tokens a step may compute from `num_computed` on: up to the end, or to `press_stop`."""
        end = self.num_tokens
        if self.press_stop is not None and num_computed < self.press_stop:
            end = self.press_stop
        return end - num_computed

    def reset_kv(self) -> None:
        """Its KV is gone (recompute preemption, a failed load): computed again from position 0."""
        self.num_computed_tokens = 0
        self.num_pruned_tokens = 0
        if self.press is not None:
            self.press.reset(self)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list (hot path:
        every step asks this of every running request)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    @property
    def has_pending_token(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING_TOKEN

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.is_finished else None


@dataclass(frozen=True)
class CacheOptions:
    """Per-request prefix-cache options: the tenant (namespace), a cache_salt (only requests with
    the same salt share blocks), and an optional pin of the prompt's first `pin_prefix_tokens`
    (default: all of it) for `pin_ttl` seconds. Given as `Engine.add_request` keywords or, the
    way vLLM prompts carry `cache_salt`, as keys of a prompt dict (that is how the server passes
    them through AsyncEngine)."""
    tenant: Optional[str] = None
    cache_salt: Optional[str] = None
    pin_ttl: Optional[float] = None
    pin_prefix_tokens: Optional[int] = None

    @classmethod
    def resolve(cls, prompt: object, **given: object) -> "CacheOptions":
        values = {name: given.get(name) for name in ("tenant", "cache_salt", "pin_ttl", "pin_prefix_tokens")}
        if isinstance(prompt, dict):
            for name in values:
                if prompt.get(name) is not None:
                    if values[name] is not None and values[name] != prompt[name]:
                        raise ValueError(f"{name} given twice with different values")
                    values[name] = prompt[name]
        options = cls(**values)
        options.validate()
        return options

    def validate(self) -> None:
        for name in ("tenant", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string")
        if self.pin_ttl is not None:
            if isinstance(self.pin_ttl, bool) or not isinstance(self.pin_ttl, (int, float)) \
                    or not math.isfinite(self.pin_ttl) or self.pin_ttl <= 0:
                raise ValueError(f"pin_ttl must be a positive number of seconds, got {self.pin_ttl!r}")
        if self.pin_prefix_tokens is not None:
            if isinstance(self.pin_prefix_tokens, bool) or not isinstance(self.pin_prefix_tokens, int) \
                    or self.pin_prefix_tokens < 1:
                raise ValueError(f"pin_prefix_tokens must be an integer >= 1, got {self.pin_prefix_tokens!r}")
            if self.pin_ttl is None:
                raise ValueError("pin_prefix_tokens needs pin_ttl")

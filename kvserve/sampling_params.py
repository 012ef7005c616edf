"""SamplingParams: the per-request description of how to pick tokens (vLLM/OpenAI field names, so
a server can build it straight from a JSON body), validated when it is made. Nearly a leaf (it holds
the structured-output constraint, itself a leaf): the engine,
the scheduler's requests and the sampler all read it; it needs nothing of theirs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from kvserve.structured.params import StructuredOutputParams

_MAX_LOGPROBS = 20
_GREEDY_EPS = 1e-5


def _fail(name: str, value: Any, requirement: str) -> None:
    raise ValueError(f"{name} {requirement}, got {value!r}")


def _check_int(name: str, value: Any, *, optional: bool = False) -> None:
    """JSON bodies can carry anything; reject non-ints early with a message naming the field
    instead of letting a comparison raise a TypeError deep inside the sampler."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, "must be an integer" + (" or null" if optional else ""))


def _check_number(name: str, value: Any) -> None:
    """Non-finite values would turn into NaN logits (e.g. -inf / inf), so refuse them here."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(name, value, "must be a finite number")


def _normalise_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def _normalise_stop_token_ids(stop_token_ids: Any) -> list[int]:
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, int) and not isinstance(stop_token_ids, bool):
        return [stop_token_ids]
    return list(stop_token_ids)


@dataclass
class SamplingParams:
    """How to generate tokens for one request (vLLM-compatible names and defaults).

    top_k of 0 or -1 disables top-k. `stop` and `stop_token_ids` are always lists after
    construction. `logprobs` is the number of top alternatives returned per generated token
    (0 = only the sampled token's logprob); `prompt_logprobs` is the same for prompt tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[str | list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # "cumulative": Engine.step returns the request's full output after every step (streaming);
    # "final_only": only once it finishes, which spares copying every running request's tokens
    # each step (the offline API uses it; at batch 256 that copy was the largest host cost).
    output_kind: str = "cumulative"
    # KV compression (kvserve/press; docs/kv_compression.md): the press that prunes this request's
    # KV once its prompt is computed, and how much it keeps (a ratio of the prunable tokens, or a
    # token budget, which is also kept as the output grows). None: the server's --kv-press defaults.
    # The press names are checked by the engine (it owns the registry); "none" turns a default off.
    kv_press: Optional[str] = None
    kv_keep_ratio: Optional[float] = None
    kv_keep_tokens: Optional[int] = None
    kv_press_mode: Optional[str] = None      # "drop" or "tier"; None: the server's --kv-press-mode
    # Its request class (--qos-config; kvserve/sched/qos_classes.py); None: its tenant's default. The
    # names are checked by the engine (the config is the scheduler's).
    qos_class: Optional[str] = None
    # Structured output (docs/structured_output.md): the grammar the output must follow, as a
    # StructuredOutputParams (a dict with its fields is accepted too). Compiled by the engine.
    structured_output: Optional[StructuredOutputParams] = None

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        if isinstance(self.structured_output, dict):
            try:
                self.structured_output = StructuredOutputParams(**self.structured_output)
            except TypeError as exc:      # a key that is not one of its fields
                raise ValueError(f"structured_output {exc}") from None
        self.validate()

    @property
    def is_greedy(self) -> bool:
        """Temperatures this small would overflow the division; treat them as argmax."""
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its value."""
        self._validate_types()
        self._validate_ranges()

    def _validate_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "kv_keep_tokens"):
            _check_int(name, getattr(self, name), optional=True)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check_number(name, getattr(self, name))
        if not all(isinstance(s, str) for s in self.stop):
            _fail("stop", self.stop, "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            # An empty string occurs in every text: the request would stop after its first token.
            _fail("stop", self.stop, "must not contain an empty string")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "must be a list of integers")
        if self.kv_press is not None and not isinstance(self.kv_press, str):
            _fail("kv_press", self.kv_press, "must be a press name (a string) or null")
        if self.qos_class is not None and not isinstance(self.qos_class, str):
            _fail("qos_class", self.qos_class, "must be a class name (a string) or null")
        if self.kv_press_mode is not None and self.kv_press_mode not in ("drop", "tier"):
            _fail("kv_press_mode", self.kv_press_mode, "must be 'drop', 'tier' or null")
        if self.kv_keep_ratio is not None:
            _check_number("kv_keep_ratio", self.kv_keep_ratio)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputParams):
            _fail("structured_output", self.structured_output, "must be a StructuredOutputParams or null")

    def _validate_ranges(self) -> None:
        if self.output_kind not in ("cumulative", "final_only"):
            _fail("output_kind", self.output_kind, "must be 'cumulative' or 'final_only'")
        if self.n < 1:
            _fail("n", self.n, "must be at least 1")
        # Sample i of n uses seed + i; torch generators take seeds in [0, 2**63) here.
        if self.seed is not None and not 0 <= self.seed <= 2**63 - 1 - self.n:
            _fail("seed", self.seed, "must be in [0, 2**63 - 1 - n]")
        if self.temperature < 0:
            _fail("temperature", self.temperature, "must be non-negative")
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            _fail("top_k", self.top_k, "must be -1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                _fail(name, getattr(self, name), "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "must be positive")
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be at least 1 (or null)")
        if self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}")
        if self.kv_keep_ratio is not None and not 0 < self.kv_keep_ratio <= 1:
            _fail("kv_keep_ratio", self.kv_keep_ratio, "must be in (0, 1]")
        if self.kv_keep_tokens is not None and self.kv_keep_tokens < 1:
            _fail("kv_keep_tokens", self.kv_keep_tokens, "must be at least 1 (or null)")
        if self.kv_keep_ratio is not None and self.kv_keep_tokens is not None:
            _fail("kv_keep_tokens", self.kv_keep_tokens, "must not be set together with kv_keep_ratio")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= _MAX_LOGPROBS:
                _fail(name, value, f"must be in [0, {_MAX_LOGPROBS}]")

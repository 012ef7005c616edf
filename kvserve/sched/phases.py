"""The phases of one traced request as the engine lives them: queued, KV loads from a tier, each
prefill chunk, decode with its steps, preemptions. Stamped by the part that knows (the
scheduler admits, loads and preempts; the engine runs steps) with time.monotonic(), one clock for
every process of the machine; the server turns them into OpenTelemetry spans once the request is
done (kvserve/obs/tracing.py). Only requests that are traced carry one, so an untraced request
costs a None check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

AttrValue = Union[str, int, float, bool]
# (name, start, end, attributes); end None: an event at `start` (e.g. one decode step).
PhaseRecord = tuple[str, float, Optional[float], dict[str, AttrValue]]

# Decode step events kept per request: a long generation keeps every 2nd, then every 4th... step,
# so a trace costs the same whatever the length.
MAX_STEP_EVENTS = 16

REQUEST = "request"             # an event with the request's own attributes (tenant, class, KV format, press)
QUEUED = "queued"
TIER_LOOKUP = "tier_lookup"     # the prefix matched in the GPU cache, then the host tier, at admission
KV_PREFETCH = "kv_prefetch"     # held while its prefix comes up from the disk / remote tiers
KV_LOAD = "kv_load"             # a host-tier prefix hit or a swap-in copying KV to the device
PREEMPTED = "preempted"         # preempted (swapped or to recompute) until admitted again
PREFILL_CHUNK = "prefill_chunk"
DECODE = "decode"
DECODE_STEP = "decode_step"     # an event of the decode span


@dataclass
class RequestPhases:
    """Closed phases, open ones, and the sampled decode steps of one request."""
    records: list[PhaseRecord] = field(default_factory=list)
    _open: dict[str, tuple[float, dict[str, AttrValue]]] = field(default_factory=dict)
    _steps: list[PhaseRecord] = field(default_factory=list)
    _step_stride: int = 1
    _steps_seen: int = 0

    def begin(self, name: str, now: float, **attrs: AttrValue) -> None:
        self._open[name] = (now, attrs)

    def end(self, name: str, now: float, **attrs: AttrValue) -> None:
        """Closes `name` if it is open (a no-op otherwise: e.g. a decode never begun)."""
        begun = self._open.pop(name, None)
        if begun is not None:
            self.records.append((name, begun[0], now, {**begun[1], **attrs}))

    def annotate(self, name: str, **counts: int) -> None:
        """Adds `counts` to the open phase `name`'s attributes (e.g. blocks a prefetch brought up)."""
        begun = self._open.get(name)
        if begun is not None:
            for key, value in counts.items():
                begun[1][key] = int(begun[1].get(key, 0)) + value

    def is_open(self, name: str) -> bool:
        return name in self._open

    def add(self, name: str, start: float, end: float, **attrs: AttrValue) -> None:
        self.records.append((name, start, end, attrs))

    def event(self, name: str, now: float, **attrs: AttrValue) -> None:
        self.records.append((name, now, None, attrs))

    def step(self, now: float, **attrs: AttrValue) -> None:
        """A decode step, kept when it falls on the stride; past MAX_STEP_EVENTS every other one
        kept is dropped and the stride doubles."""
        seen, self._steps_seen = self._steps_seen, self._steps_seen + 1
        if seen % self._step_stride:
            return
        self._steps.append((DECODE_STEP, now, None, {"step": seen, **attrs}))
        if len(self._steps) > MAX_STEP_EVENTS:
            self._steps = self._steps[::2]
            self._step_stride *= 2

    def finish(self, now: float) -> list[PhaseRecord]:
        """Closes what is open at `now` (decode with its step count) and returns every record,
        the kept decode steps included."""
        if DECODE in self._open:
            self.end(DECODE, now, steps=self._steps_seen)
        for name in list(self._open):
            self.end(name, now)
        return self.records + self._steps

"""Run-time reconfiguration: the engine settings an operator may change while serving (the admin
config API, server/admin_config.py), checked as their flags are checked at start, applied between
steps, all or none; and the log of every change, the operator's and the engine's own.

Each setting and what it reaches:
- eviction_policy, lru_k, heat_half_life_s: the prefix cache's ranking. The evictable blocks are
  re-keyed under the new policy at once and keep their access histories; a new adaptive policy
  starts its shadow caches empty and learns from the traffic that follows.
- slo_ttft, slo_tpot: the scheduler's latency controller (step length, running limit, shedding),
  made when a first target is set on an engine that had none (its step-cost model is calibrated
  then, as at start), dropped when the last goes (without request classes).
- qos_classes.<class>.ttft_p99 / .tpot_p99: a request class's p99 targets.
- kv_press, kv_keep_ratio, kv_keep_tokens, kv_press_mode: the press defaults of requests admitted
  from now on (a running request keeps the plan it was admitted with).
- kv_host_memory: the host KV tier's size, between one store segment and what was allocated at
  start (its memory is allocated then; a shrunk tier gives its segments back to the OS).
- max_num_batched_tokens: the token budget of a step (prefill chunks + decodes).

Events (kvserve/stats.py ConfigEvent): "admin" for each change made here, "adaptive" each time the
adaptive eviction policy switches arm, "auto" each time memory pressure resizes the host tier. The
engine keeps the last EVENT_HISTORY of them and a count per (field, source) since start.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import msgspec

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, _parse_bytes
from kvserve.engine.press_control import NO_PRESS, PressControl
from kvserve.kvcache.prefix_cache import policy_from_config
from kvserve.sched.qos_config import check_class
from kvserve.stats import ConfigEvent, RuntimeConfigStats

if TYPE_CHECKING:
    import torch

    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.kvcache.memory_pressure import HostTierSizer
    from kvserve.kvcache.prefix_control import PrefixControl
    from kvserve.kvstore import KVCacheStore
    from kvserve.sched.scheduler import Scheduler

logger = logging.getLogger("kvserve")

EVENT_HISTORY = 64              # config events the engine keeps (the dashboard lists them)
ADMIN, ADAPTIVE, AUTO = "admin", "adaptive", "auto"

EVICTION_FIELDS = ("eviction_policy", "lru_k", "heat_half_life_s")
PRESS_FIELDS = ("kv_press", "kv_keep_ratio", "kv_keep_tokens", "kv_press_mode")
LATENCY_FIELDS = ("slo_ttft", "slo_tpot")
HOST_FIELD = "kv_host_memory"
BUDGET_FIELD = "max_num_batched_tokens"
# Flat fields by the config part that holds them.
CACHE_FIELDS = EVICTION_FIELDS + PRESS_FIELDS + (HOST_FIELD,)
SCHEDULER_FIELDS = LATENCY_FIELDS + (BUDGET_FIELD,)
QOS_CLASSES = "qos_classes"                     # {class: {ttft_p99, tpot_p99}}
CLASS_TARGETS = ("ttft_p99", "tpot_p99")
RECONFIGURABLE = CACHE_FIELDS + SCHEDULER_FIELDS + (QOS_CLASSES,)
# Settings that name a choice rather than a number (RuntimeConfigStats.choices).
CHOICE_FIELDS = ("eviction_policy", "kv_press", "kv_press_mode")
# Optional flags whose None is a default resolved at start (by the device): at run time they take a value.
NEEDS_VALUE = (HOST_FIELD, BUDGET_FIELD)


class Reconfigurable(Protocol):
    """What reconfiguration reaches in the engine (engine.Engine): the parts that own each setting."""
    config: EngineConfig                  # the engine's copy of its options, kept current
    device: "torch.device"
    scheduler: "Scheduler"                # latency targets, classes, the token budget
    prefix: "PrefixControl"               # the eviction policy
    press: PressControl                   # the press defaults
    kv_manager: "KVCacheManager"          # the host tier's accounting, the pool's size
    host_store: Optional["KVCacheStore"]  # the host tier's memory (None: no host tier)
    host_sizer: Optional["HostTierSizer"]  # memory pressure's sizer (None: off)
    kv_bytes_per_token: int
    initial_max_num_batched_tokens: int   # the budget at start (what a GPU's memory was profiled for)

    def calibrate_step_cost(self) -> None: ...

    def set_host_tier_blocks(self, target: int) -> int: ...

    def runtime_config(self) -> dict[str, Any]: ...

    def reconfigure(self, changes: dict[str, Any]) -> list["ConfigChange"]: ...


@dataclass(frozen=True)
class ConfigChange:
    """One setting changed: by its flag's field name, or qos_classes.<class>.<target>."""
    field: str
    old: Any
    new: Any


def _text(value: Any) -> str:
    return "none" if value is None else str(value)


class ConfigEventLog:
    """The latest config events (bounded) and a count per field and source since start."""

    def __init__(self, capacity: int = EVENT_HISTORY, clock: Callable[[], float] = time.time) -> None:
        self._events: collections.deque[ConfigEvent] = collections.deque(maxlen=capacity)
        self.changes: dict[str, dict[str, int]] = {}
        self.clock = clock
        self.version = 0            # bumped by every event: what readers cache their copies on
        self._frozen: tuple[int, tuple[ConfigEvent, ...]] = (0, ())

    def record(self, source: str, field: str, old: Any, new: Any, why: str = "") -> ConfigEvent:
        event = ConfigEvent(self.clock(), source, field, _text(old), _text(new))
        self._events.append(event)
        by_source = self.changes.setdefault(field, {})
        by_source[source] = by_source.get(source, 0) + 1
        self.version += 1
        logger.info("config change (%s): %s %s -> %s%s", source, field, event.old, event.new,
                    f" ({why})" if why else "")
        return event

    def events(self) -> tuple[ConfigEvent, ...]:
        """The latest events, oldest first (the same tuple until the next event: stats take it every step)."""
        if self._frozen[0] != self.version:
            self._frozen = (self.version, tuple(self._events))
        return self._frozen[1]


class RuntimeConfig:
    """The engine's reconfigurable settings: read (`current`), checked and changed (`reconfigure`),
    and reported (`make_stats`). Runs on the engine thread, between steps."""

    def __init__(self, engine: Reconfigurable) -> None:
        self.engine = engine
        self.events = ConfigEventLog()
        self._stats: Optional[tuple[int, RuntimeConfigStats]] = None
        cache = engine.kv_manager.prefix_cache
        if cache is not None:
            cache.on_policy_switch = self._arm_switched

    def _arm_switched(self, old: str, new: str) -> None:
        self.events.record(ADAPTIVE, "eviction_policy", old, new)

    # --- reading --------------------------------------------------------------------------------
    def current(self) -> dict[str, Any]:
        """Every reconfigurable setting as the engine uses it now (eviction_policy "off" without
        prefix caching, kv_host_memory 0 without a host tier)."""
        engine = self.engine
        cache, sched, press = engine.config.cache_config, engine.scheduler.config, engine.press
        classes = engine.scheduler.qos.classes
        return {
            "eviction_policy": engine.prefix.policy_name, "lru_k": cache.lru_k,
            "heat_half_life_s": cache.heat_half_life_s,
            "slo_ttft": sched.slo_ttft, "slo_tpot": sched.slo_tpot,
            QOS_CLASSES: {name: {"ttft_p99": cls.ttft_p99, "tpot_p99": cls.tpot_p99}
                          for name, cls in sorted(classes.items())},
            "kv_press": press.default_press, "kv_keep_ratio": press.default_ratio,
            "kv_keep_tokens": press.default_tokens, "kv_press_mode": press.default_mode,
            HOST_FIELD: self._host_limit_blocks() * self._host_block_bytes(),
            BUDGET_FIELD: sched.max_num_batched_tokens,
        }

    def make_stats(self) -> RuntimeConfigStats:
        """The settings as stats data (kept until the next event: make_stats runs every step)."""
        if self._stats is not None and self._stats[0] == self.events.version:
            return self._stats[1]
        values: dict[str, float] = {}
        choices: dict[str, str] = {}
        for name, value in self.current().items():
            if name == QOS_CLASSES:
                for cls, targets in value.items():
                    values.update({f"{QOS_CLASSES}.{cls}.{target}": float(seconds)
                                   for target, seconds in targets.items() if seconds is not None})
            elif name in CHOICE_FIELDS:
                choices[name] = _text(value)
            elif value is not None:
                values[name] = float(value)
        stats = RuntimeConfigStats(values, choices, {f: dict(s) for f, s in self.events.changes.items()})
        self._stats = (self.events.version, stats)
        return stats

    # --- changing -------------------------------------------------------------------------------
    def reconfigure(self, changes: dict[str, Any]) -> list[ConfigChange]:
        """Checks every change first (a ValueError naming the field, and nothing applied), then
        applies them all; returns those that changed a value (a value given as it already is
        changes nothing), each logged and recorded as an "admin" event."""
        plan = self._plan(changes)
        applied = self._apply(plan)
        for change in applied:
            self.events.record(ADMIN, change.field, change.old, change.new)
        return applied

    def _plan(self, changes: dict[str, Any]) -> "_Plan":
        if not isinstance(changes, dict):
            raise ValueError(f"the changes are an object of field: new value, not {type(changes).__name__}")
        engine = self.engine
        old = self.current()
        flat: dict[str, Any] = {}
        classes: dict[str, Any] = {}
        for name, value in changes.items():
            if name == QOS_CLASSES:
                classes = self._plan_classes(value)
            elif name in CACHE_FIELDS or name in SCHEDULER_FIELDS:
                flat[name] = _typed(name, value)
                if name == "kv_press" and flat[name] == NO_PRESS:
                    flat[name] = None                   # the same default: no press
            else:
                raise ValueError(_not_reconfigurable(name))
        # The flags' own checks (choices, ranges, the rules between fields) on the config as it
        # would be: the same messages as at start.
        cache = dataclasses.replace(engine.config.cache_config, **{k: v for k, v in flat.items() if k in CACHE_FIELDS})
        sched = dataclasses.replace(engine.scheduler.config,
                                    **{k: v for k, v in flat.items() if k in SCHEDULER_FIELDS})
        EngineConfig(engine.config.model_config, cache, sched).validate()
        flat = {k: v for k, v in flat.items() if v != old[k]}
        if any(name in flat for name in EVICTION_FIELDS) and not engine.prefix.enabled:
            raise ValueError(f"{next(n for n in EVICTION_FIELDS if n in flat)}: prefix caching is off "
                             f"(--no-prefix-caching), so no eviction policy runs")
        if any(name in flat for name in PRESS_FIELDS):
            engine.press.check_defaults(cache.kv_press, cache.kv_keep_ratio, cache.kv_keep_tokens,
                                        cache.kv_press_mode)
        host_blocks = self._plan_host(flat[HOST_FIELD]) if HOST_FIELD in flat else None
        if host_blocks is not None:
            flat[HOST_FIELD] = host_blocks * self._host_block_bytes()
            if flat[HOST_FIELD] == old[HOST_FIELD]:
                del flat[HOST_FIELD]
        if BUDGET_FIELD in flat:
            self._check_budget(flat[BUDGET_FIELD])
        return _Plan(old, flat, cache, classes, host_blocks)

    def _plan_classes(self, value: Any) -> dict[str, Any]:
        """{class: new QoSClass} for the classes whose targets change."""
        classes = self.engine.scheduler.qos.classes
        if not isinstance(value, dict):
            raise ValueError(f"{QOS_CLASSES} must be an object of class name: {{ttft_p99, tpot_p99}}, "
                             f"got {value!r}")
        planned = {}
        for name, targets in value.items():
            where = f"{QOS_CLASSES}.{name}"
            if name not in classes:
                known = ", ".join(sorted(classes)) if classes else "none are configured (--qos-config defines them)"
                raise ValueError(f"{where}: no such request class; classes: {known}")
            if not isinstance(targets, dict):
                raise ValueError(f"{where} must be an object of targets (ttft_p99, tpot_p99), got {targets!r}")
            for key in targets:
                if key not in CLASS_TARGETS:
                    raise ValueError(f"{where}.{key} cannot change at run time; a class's "
                                     f"{' and '.join(CLASS_TARGETS)} can (the rest: --qos-config, and a restart)")
            new = msgspec.structs.replace(classes[name], **targets)
            check_class(where, new)
            planned[name] = msgspec.structs.replace(new, **{k: float(v) for k, v in targets.items() if v is not None})
        return planned

    def _plan_host(self, requested: int) -> int:
        """The host tier's new size in blocks: whole store segments, within what start allocated."""
        engine = self.engine
        tier = engine.kv_manager.host_tier
        if tier is None or engine.host_store is None:
            raise ValueError(f"{HOST_FIELD}: the host KV tier is off (--kv-host-memory 0, prefix caching off, or "
                             f"the CPU default); it is allocated at start, so turning it on needs a restart")
        block_bytes, segment = self._host_block_bytes(), engine.host_store.flat.segment_blocks
        allocated = tier.num_blocks * block_bytes
        if requested == 0:
            raise ValueError(f"{HOST_FIELD} 0 would turn the host KV tier off, which needs a restart; the smallest "
                             f"size is one segment of it, {segment * block_bytes} bytes")
        if requested > allocated:
            raise ValueError(f"{HOST_FIELD} of {requested} bytes exceeds the {allocated} bytes the host KV tier "
                             f"allocated at start: it can shrink and grow back up to that; more needs a restart "
                             f"with a larger --kv-host-memory")
        blocks = requested // block_bytes
        if blocks < 1:
            raise ValueError(f"{HOST_FIELD} of {requested} bytes holds no KV block ({block_bytes} bytes)")
        return min(tier.num_blocks, -(-blocks // segment) * segment)

    def _check_budget(self, budget: int) -> None:
        engine = self.engine
        start = engine.initial_max_num_batched_tokens
        if engine.device.type == "cuda" and budget > start:
            raise ValueError(f"{BUDGET_FIELD} {budget} exceeds {start}, the budget the GPU's memory was "
                             f"profiled for at start (activations of a step that size); more needs a restart")
        scheduler = engine.scheduler
        if not scheduler.config.enable_chunked_prefill:
            longest = max((r.num_tokens for r in scheduler.requests.values() if not r.is_finished), default=0)
            if budget < longest:
                raise ValueError(f"{BUDGET_FIELD} {budget} is below the {longest} tokens of a request in the "
                                 f"engine, which without chunked prefill must be computed in one step")

    def _apply(self, plan: "_Plan") -> list[ConfigChange]:
        engine, flat, old = self.engine, plan.flat, plan.old
        applied: list[ConfigChange] = []
        # The host tier first: growing it allocates memory, the one step here that can fail, and
        # nothing else has changed yet if it does.
        if plan.host_blocks is not None and HOST_FIELD in flat:
            self._set_host_limit(plan.host_blocks)
            engine.config.cache_config.kv_host_memory = flat[HOST_FIELD]
        cache = engine.config.cache_config
        if any(name in flat for name in EVICTION_FIELDS):
            for name in EVICTION_FIELDS:
                setattr(cache, name, getattr(plan.cache, name))
            engine.prefix.set_policy(cache.eviction_policy, policy_from_config(cache, engine.kv_manager.num_blocks))
        if any(name in flat for name in PRESS_FIELDS):
            for name in PRESS_FIELDS:
                setattr(cache, name, getattr(plan.cache, name))
            engine.press.set_defaults(cache.kv_press, cache.kv_keep_ratio, cache.kv_keep_tokens, cache.kv_press_mode)
        if any(name in flat for name in LATENCY_FIELDS):
            sched = engine.scheduler.config
            ttft, tpot = flat.get("slo_ttft", sched.slo_ttft), flat.get("slo_tpot", sched.slo_tpot)
            if engine.scheduler.set_latency_targets(ttft, tpot):
                engine.calibrate_step_cost()
        if BUDGET_FIELD in flat:
            # The scheduler reads it every step (its config is the engine's scheduler_config).
            engine.scheduler.config.max_num_batched_tokens = flat[BUDGET_FIELD]
        for name in RECONFIGURABLE:
            if name in flat:
                applied.append(ConfigChange(name, old[name], flat[name]))
        for name, cls in plan.classes.items():
            before = old[QOS_CLASSES][name]
            engine.scheduler.set_class(name, cls)
            for target in CLASS_TARGETS:
                if getattr(cls, target) != before[target]:
                    applied.append(ConfigChange(f"{QOS_CLASSES}.{name}.{target}", before[target], getattr(cls, target)))
        return applied

    # --- the host tier's size -------------------------------------------------------------------
    def _host_block_bytes(self) -> int:
        engine = self.engine
        return engine.kv_bytes_per_token * engine.config.cache_config.block_size

    def _host_limit_blocks(self) -> int:
        """The size the host tier keeps while memory is calm (memory pressure may hold it lower)."""
        engine = self.engine
        tier = engine.kv_manager.host_tier
        if tier is None or engine.host_store is None:
            return 0
        return engine.host_sizer.max_blocks if engine.host_sizer is not None else tier.capacity

    def _set_host_limit(self, blocks: int) -> None:
        """A new size: a smaller one at once; a larger one at once too, unless memory pressure holds
        the tier below its old size now (its sizer then grows it back in steps, once calm)."""
        engine, sizer = self.engine, self.engine.host_sizer
        tier = engine.kv_manager.host_tier
        held_down = sizer is not None and tier.capacity < sizer.max_blocks
        if sizer is not None:
            sizer.max_blocks = blocks
            sizer.min_blocks = min(sizer.min_blocks, blocks)
        target = min(blocks, tier.capacity) if held_down else blocks
        if target != tier.capacity:
            engine.set_host_tier_blocks(target)


@dataclass
class _Plan:
    """Checked changes, not yet applied."""
    old: dict[str, Any]                 # RuntimeConfig.current() before
    flat: dict[str, Any]                # flat field -> new value (only those that change)
    cache: CacheConfig                  # the cache config as it will be (its eviction and press fields)
    classes: dict[str, Any]             # class -> its new QoSClass
    host_blocks: Optional[int]          # the host tier's new size in blocks (None: unchanged)


def _field(name: str) -> dataclasses.Field:
    for part in (CacheConfig, SchedulerConfig):
        for f in dataclasses.fields(part):
            if f.name == name:
                return f
    raise KeyError(name)


def _typed(name: str, value: Any) -> Any:
    """`value` as the flag's type (a size may be given as '2GiB', as the flag takes it); a
    ValueError naming the field for a value of another type."""
    f = _field(name)
    kind = str(f.type)
    if value is None:
        if kind.startswith("Optional") and name not in NEEDS_VALUE:
            return None
        raise ValueError(f"{name} needs a value (it cannot be unset)")
    if f.metadata.get("bytes") and isinstance(value, str):
        try:
            return _parse_bytes(value)
        except ValueError:
            raise ValueError(f"{name} must be a number of bytes or a size such as '2GiB', got {value!r}") from None
    if "int" in kind:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if "float" in kind:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value


def _not_reconfigurable(name: str) -> str:
    known = {f.name for part in (ModelConfig, CacheConfig, SchedulerConfig) for f in dataclasses.fields(part)}
    can = ", ".join(RECONFIGURABLE)
    if name in known:
        return (f"{name} cannot change at run time (restart with --{name.replace('_', '-')}); the settings that "
                f"can: {can}")
    return f"{name} is not an engine setting; the settings that can change at run time: {can}"


def reconfigure_reply(engine: Reconfigurable, changes: dict[str, Any]) -> dict[str, Any]:
    """What both engine clients answer a reconfigure call with (plain data: it crosses the engine
    core's socket): the changes that took effect, by field, and every setting after them."""
    applied = engine.reconfigure(changes)
    return {"changed": {change.field: {"old": change.old, "new": change.new} for change in applied},
            "config": engine.runtime_config()}

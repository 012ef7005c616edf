"""EngineConfig.validate(): every option is checked from its field's metadata (bounds, choices,
checks), plus the cross-field rules; messages name the field and the value."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvserve.config import Bounds, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, bounds, check_fields

PARTS = (ModelConfig, CacheConfig, SchedulerConfig)


def _fields_with(key: str):
    return [f for part in PARTS for f in dataclasses.fields(part) if key in f.metadata]


def _outside(limits: Bounds, integer: bool) -> list[float]:
    """Values just past each bound the field has."""
    step = 1 if integer else 1e-3
    values = []
    if limits.ge is not None:
        values.append(limits.ge - step)
    if limits.gt is not None:
        values.append(limits.gt)
    if limits.le is not None:
        values.append(limits.le + step)
    if limits.lt is not None:
        values.append(limits.lt)
    return values


def _inside(limits: Bounds, integer: bool) -> float:
    low = limits.ge if limits.ge is not None else (limits.gt + (1 if integer else 1e-3)
                                                    if limits.gt is not None else None)
    high = limits.le if limits.le is not None else (limits.lt - (1 if integer else 1e-3)
                                                     if limits.lt is not None else None)
    return low if low is not None else high if high is not None else 1


BOUNDED = _fields_with("bounds")


def test_the_numeric_options_have_bounds():
    names = {f.name for f in BOUNDED}
    assert {"block_size", "kv_cache_memory", "gpu_memory_utilization", "gemv_max_tokens", "lru_k",
            "heat_half_life_s", "max_pinned_fraction", "max_num_seqs", "max_num_batched_tokens", "slo_ttft",
            "slo_tpot", "cache_aware_max_bypass", "max_model_len", "kv_quant_group_size", "kv_quant_window",
            "kv_quant_sinks", "kv_full_precision_first_layers", "kv_full_precision_last_layers"} <= names


@pytest.mark.parametrize("field", BOUNDED, ids=lambda f: f.name)
def test_every_bounded_field_rejects_out_of_range_values(field):
    limits: Bounds = field.metadata["bounds"]
    integer = "int" in str(field.type)
    outside = _outside(limits, integer)
    assert outside, f"{field.name} has bounds metadata without a bound"
    for value in outside:
        with pytest.raises(ValueError, match=rf"^{field.name} must be .*, got {value}$"):
            EngineConfig.from_options(**{field.name: value})
    EngineConfig.from_options(**{field.name: _inside(limits, integer)})      # the edge itself is allowed
    if not integer:
        with pytest.raises(ValueError, match=field.name):
            EngineConfig.from_options(**{field.name: math.nan})
    with pytest.raises(ValueError, match=rf"{field.name} must be a number"):
        EngineConfig.from_options(**{field.name: "3"})


@pytest.mark.parametrize("field", _fields_with("choices"), ids=lambda f: f.name)
def test_every_choice_field_rejects_other_values(field):
    with pytest.raises(ValueError, match=rf"^{field.name} must be one of .*, got 'no-such-choice'$"):
        EngineConfig.from_options(**{field.name: "no-such-choice"})
    for choice in field.metadata["choices"]:
        EngineConfig.from_options(**{field.name: choice})


def test_messages_keep_their_wording():
    cases = {
        "block_size must be >= 1, got 0": dict(block_size=0),
        "kv_cache_memory must be > 0 bytes, got 0": dict(kv_cache_memory=0),
        "gemv_max_tokens must be in [0, 16], got 17": dict(gemv_max_tokens=17),
        "gpu_memory_utilization must be in (0, 1], got 1.5": dict(gpu_memory_utilization=1.5),
        "lru_k must be in [1, 8], got 0": dict(lru_k=0),
        "slo_ttft must be > 0 seconds, got -1.0": dict(slo_ttft=-1.0),
        "max_model_len must be >= 2, got 1": dict(max_model_len=1),
    }
    for message, options in cases.items():
        with pytest.raises(ValueError) as info:
            EngineConfig.from_options(**options)
        assert str(info.value) == message


def test_kv_cache_dtypes_are_checked_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown KV cache dtype 'int3'"):
        EngineConfig.from_options(kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype_v: KV cache dtype 'fp8_e5m2' is not supported"):
        EngineConfig.from_options(kv_cache_dtype_v="fp8_e5m2")
    EngineConfig.from_options(kv_cache_dtype="fp8", kv_cache_dtype_k="bfloat16")


def test_unset_optional_fields_pass_and_cross_field_rules_still_apply():
    EngineConfig.from_options()
    with pytest.raises(ValueError, match="slo_shed needs slo_ttft"):
        EngineConfig.from_options(slo_shed=True)
    EngineConfig.from_options(slo_shed=True, slo_ttft=0.5)


def test_validate_checks_a_config_built_by_hand():
    config = EngineConfig(cache_config=CacheConfig(block_size=0))
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        config.validate()


def test_bounds_metadata_on_any_dataclass():
    @dataclasses.dataclass
    class Options:
        ratio: float = dataclasses.field(default=0.5, metadata=bounds(ge=0, lt=1))
        count: int = dataclasses.field(default=3, metadata=bounds(le=10, unit="items"))

    check_fields(Options())
    with pytest.raises(ValueError, match=r"^ratio must be in \[0, 1\), got 1$"):
        check_fields(Options(ratio=1))
    with pytest.raises(ValueError, match=r"^count must be <= 10 items, got 11$"):
        check_fields(Options(count=11))

"""Engine.reconfigure: each setting the admin config API may change reaches the code that uses it
(a new eviction policy evicts another block, a smaller token budget cuts smaller prefill chunks, a
TPOT target lowers the running limit, a TTFT target caps the step, a class's target holds the
scheduler's step time, press defaults prune new requests, the host tier gives its memory back);
a refused change names its field and changes nothing; every change is an event, the operator's
("admin"), the adaptive policy's arm switches ("adaptive") and memory pressure's resizes ("auto")."""

from __future__ import annotations

import json

import pytest

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import SamplingParams
from kvserve.engine.engine import Engine
from kvserve.engine.runtime_config import EVENT_HISTORY
from kvserve.kvcache.memory_pressure import PressureMonitor

BLOCK = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("reconfigure-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def block_bytes(folder):
    return _engine(folder).kv_bytes_per_token * BLOCK


def _engine(folder: str, **options) -> Engine:
    base = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=2 << 20, block_size=BLOCK,
                max_model_len=256, async_scheduling="off")
    return Engine.from_options(**{**base, **options})


def _run(engine: Engine, prompt: list[int], max_tokens: int = 1, request_id: str = "r") -> None:
    engine.add_request(request_id, {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _prompt(seed: int, length: int) -> list[int]:
    return [3 + (seed * 31 + 7 * i) % 240 for i in range(length)]


# --- eviction policy -------------------------------------------------------------------------------
@pytest.mark.parametrize("start,changed,evicted", [("lru-k", "lru", "twice"), ("lru", "lru-k", "once")])
def test_the_new_eviction_policy_chooses_the_victim(folder, block_bytes, start, changed, evicted):
    """One cached block used twice, then one used once: lru evicts the one used longest ago (the
    twice-used), lru-k (K=2) the one used fewer than K times. The ranking in force after the change
    decides, whichever policy the engine started with."""
    engine = _engine(folder, kv_cache_memory=block_bytes * 12, eviction_policy=start)
    twice, once = _prompt(1, BLOCK + 1), _prompt(2, BLOCK + 1)
    for index, prompt in enumerate((twice, twice, once)):
        _run(engine, prompt, request_id=f"warm{index}")
    changes = engine.reconfigure({"eviction_policy": changed})
    assert [(c.field, c.old, c.new) for c in changes] == [("eviction_policy", start, changed)]
    assert engine.make_stats().prefix_cache.active_policy.startswith(changed)
    # A prompt that needs every empty block and one more: exactly one cached block goes.
    stats = engine.make_stats()
    empty = stats.kv_cache.num_free_blocks - stats.prefix_cache.evictable_blocks
    _run(engine, _prompt(3, (empty + 1) * BLOCK - 1), request_id="pressure")
    kept = {name: engine.estimate_cached_prompt_tokens(prompt) for name, prompt in (("twice", twice), ("once", once))}
    assert kept == {"twice": 0 if evicted == "twice" else BLOCK, "once": 0 if evicted == "once" else BLOCK}


def test_policy_parameters_rebuild_the_ranking(folder):
    engine = _engine(folder, eviction_policy="lru-k")
    engine.reconfigure({"lru_k": 3, "heat_half_life_s": 30})
    assert engine.make_stats().prefix_cache.active_policy == "lru-k(k=3,h=30s)"
    assert engine.runtime_config()["lru_k"] == 3 and engine.config.cache_config.heat_half_life_s == 30.0


def test_without_prefix_caching_there_is_no_policy_to_change(folder):
    engine = _engine(folder, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="^eviction_policy: prefix caching is off"):
        engine.reconfigure({"eviction_policy": "lru-k"})


# --- token budget ----------------------------------------------------------------------------------
def test_a_smaller_token_budget_cuts_smaller_prefill_chunks(folder):
    engine = _engine(folder)
    prompt = _prompt(4, 200)
    engine.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.reconfigure({"max_num_batched_tokens": 48})
    engine.step()
    assert engine.scheduler.requests["a"].num_computed_tokens == 48
    engine.step()
    assert engine.scheduler.requests["a"].num_computed_tokens == 96
    engine.reconfigure({"max_num_batched_tokens": 1024})
    engine.step()
    assert engine.scheduler.requests["a"].num_computed_tokens == 200      # the rest in one chunk


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the GPU's memory is profiled for the budget at start")
def test_on_a_gpu_the_budget_stays_within_what_its_memory_was_profiled_for(folder):
    engine = _engine(folder, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="^max_num_batched_tokens 1024 exceeds 512, the budget the GPU's memory"):
        engine.reconfigure({"max_num_batched_tokens": 1024})
    engine.reconfigure({"max_num_batched_tokens": 256})
    engine.reconfigure({"max_num_batched_tokens": 512})


def test_without_chunked_prefill_the_budget_stays_above_the_requests_in_the_engine(folder):
    engine = _engine(folder, enable_chunked_prefill=False)
    engine.add_request("a", {"prompt_token_ids": _prompt(5, 100)}, SamplingParams(max_tokens=2, ignore_eos=True))
    start = engine.runtime_config()["max_num_batched_tokens"]
    with pytest.raises(ValueError, match="^max_num_batched_tokens 64 is below the 100 tokens"):
        engine.reconfigure({"max_num_batched_tokens": 64})
    assert engine.runtime_config()["max_num_batched_tokens"] == start
    engine.reconfigure({"max_num_batched_tokens": 100})


# --- latency targets -------------------------------------------------------------------------------
def test_a_tpot_target_set_at_run_time_lowers_the_running_limit(folder):
    engine = _engine(folder, max_num_seqs=8)
    assert engine.scheduler.slo is None and engine.make_stats().scheduler.latency is None
    for index in range(8):
        engine.add_request(f"r{index}", {"prompt_token_ids": _prompt(index, 20)},
                           SamplingParams(max_tokens=60, ignore_eos=True))
    engine.step()
    assert engine.num_running == 8
    # Far below any step this machine takes: every step is over it, so the limit is cut.
    engine.reconfigure({"slo_tpot": 1e-6})
    latency = engine.make_stats().scheduler.latency
    assert latency.tpot_target_s == 1e-6 and latency.step_cost is not None     # calibrated when made
    for _ in range(30):
        engine.step()
    assert engine.make_stats().scheduler.latency.max_running < 8
    # Unset: plain continuous batching again.
    engine.reconfigure({"slo_tpot": None})
    assert engine.scheduler.slo is None and engine.make_stats().scheduler.latency is None
    assert engine.runtime_config()["slo_tpot"] is None


def test_a_ttft_target_caps_the_step(folder):
    engine = _engine(folder)
    budget = engine.config.scheduler_config.max_num_batched_tokens
    assert engine.scheduler.step_token_budget() == budget
    # A step may take a quarter of the target: at 1 ms, far fewer tokens than the budget.
    engine.reconfigure({"slo_ttft": 0.001})
    assert engine.scheduler.step_token_budget() < budget // 4
    assert engine.make_stats().scheduler.latency.step_token_budget == engine.scheduler.step_token_budget()
    engine.reconfigure({"slo_ttft": 1000.0})
    assert engine.scheduler.step_token_budget() == budget


def test_shedding_keeps_its_ttft_target(folder):
    engine = _engine(folder, slo_ttft=5.0, slo_shed=True)
    with pytest.raises(ValueError, match="slo_shed needs slo_ttft"):
        engine.reconfigure({"slo_ttft": None})
    engine.reconfigure({"slo_ttft": 2.0})
    assert engine.scheduler.slo.shed_deadline_s() == pytest.approx(2.0 * 0.9)


# --- request classes -------------------------------------------------------------------------------
def _qos_engine(folder: str, tmp_path) -> Engine:
    path = tmp_path / "qos.json"
    path.write_text(json.dumps({"classes": {"gold": {"priority": 0, "ttft_p99": 5.0, "tpot_p99": 1.0,
                                                     "on_miss": "shed"},
                                            "bronze": {"priority": 2, "ttft_p99": 60.0}}}))
    return _engine(folder, scheduling_policy="priority", qos_config=str(path))


def test_a_class_tpot_target_holds_the_step_time(folder, tmp_path):
    engine = _qos_engine(folder, tmp_path)
    engine.add_request("g", {"prompt_token_ids": _prompt(6, 20)},
                       SamplingParams(max_tokens=20, ignore_eos=True, qos_class="gold"))
    engine.step()
    assert engine.scheduler.slo.class_tpot_s == 1.0
    changes = engine.reconfigure({"qos_classes": {"gold": {"tpot_p99": 0.25}}})
    assert [(c.field, c.old, c.new) for c in changes] == [("qos_classes.gold.tpot_p99", 1.0, 0.25)]
    engine.step()
    assert engine.scheduler.slo.class_tpot_s == 0.25
    assert engine.scheduler.slo.step_time_target_s == pytest.approx(0.25 * 0.85)
    gold = next(c for c in engine.make_stats().scheduler.classes if c.name == "gold")
    assert (gold.ttft_target_s, gold.tpot_target_s) == (5.0, 0.25)
    assert engine.runtime_config()["qos_classes"]["gold"] == {"ttft_p99": 5.0, "tpot_p99": 0.25}


@pytest.mark.parametrize("classes,message", [
    ({"platinum": {"ttft_p99": 1}}, r"^qos_classes.platinum: no such request class; classes: bronze, gold"),
    ({"gold": {"ttft_p99": None}}, r"^qos_classes.gold sheds \(on_miss: shed\) but has no ttft_p99"),
    ({"bronze": {"ttft_p99": None}}, r"^qos_classes.bronze has no target"),
    ({"gold": {"ttft_p99": 0}}, r"^qos_classes.gold.ttft_p99 must be a positive number of seconds"),
    ({"gold": {"ttft_p99": "1"}}, r"^qos_classes.gold.ttft_p99 must be a positive number"),
    ({"gold": {"priority": 3}}, r"^qos_classes.gold.priority cannot change at run time"),
    ({"gold": 1.0}, r"^qos_classes.gold must be an object"),
])
def test_class_targets_are_checked_as_the_qos_config_file_is(folder, tmp_path, classes, message):
    engine = _qos_engine(folder, tmp_path)
    with pytest.raises(ValueError, match=message):
        engine.reconfigure({"qos_classes": classes, "lru_k": 3})
    assert engine.runtime_config()["lru_k"] == 2


def test_without_classes_a_class_target_is_refused(folder):
    with pytest.raises(ValueError, match="none are configured"):
        _engine(folder).reconfigure({"qos_classes": {"gold": {"ttft_p99": 1.0}}})


# --- press defaults --------------------------------------------------------------------------------
def test_press_defaults_prune_the_requests_admitted_after_the_change(folder):
    engine = _engine(folder, kv_press_min_tokens=32)
    engine.add_request("before", {"prompt_token_ids": _prompt(7, 120)}, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.reconfigure({"kv_press": "streaming_llm", "kv_keep_ratio": 0.5})
    engine.add_request("after", {"prompt_token_ids": _prompt(8, 120)}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.scheduler.requests["before"].press is None              # admitted with the old defaults
    while engine.has_unfinished_requests():
        engine.step()
    (press,) = engine.make_stats().presses
    assert (press.press, press.applied) == ("streaming_llm", 1) and press.tokens_pruned > 0
    engine.reconfigure({"kv_press": None, "kv_keep_ratio": None})
    assert engine.press.plan_for(SamplingParams()) is None


@pytest.mark.parametrize("changes,message", [
    ({"kv_press": "bogus", "kv_keep_ratio": 0.5}, r"^--kv-press 'bogus' is not a press"),
    ({"kv_press": "snapkv"}, r"^--kv-press needs --kv-keep-ratio or --kv-keep-tokens"),
    ({"kv_keep_ratio": 0.5, "kv_keep_tokens": 64}, r"kv_keep_ratio and kv_keep_tokens are two ways"),
    ({"kv_keep_ratio": 1.5}, r"^kv_keep_ratio must be in \(0, 1\], got 1.5"),
    ({"kv_press_mode": "tier"}, r"^--kv-press-mode 'tier' .* host KV tier, which is off"),
    ({"kv_press_mode": "squeeze"}, r"^kv_press_mode must be one of \('drop', 'tier'\), got 'squeeze'"),
])
def test_press_defaults_are_checked_as_the_flags_are(folder, changes, message):
    engine = _engine(folder, kv_host_memory=0)          # no host tier (on a GPU there is one by default)
    with pytest.raises(ValueError, match=message):
        engine.reconfigure(changes)
    assert engine.runtime_config()["kv_press"] is None and engine.press.default_ratio is None


# --- host tier size --------------------------------------------------------------------------------
def test_the_host_tier_shrinks_and_grows_back_within_its_allocation(folder, block_bytes):
    engine = _engine(folder, kv_host_memory=block_bytes * 64)
    store, tier = engine.host_store, engine.kv_manager.host_tier
    segment = store.flat.segment_blocks
    assert (tier.capacity, store.flat.num_live_blocks, segment) == (64, 64, 8)
    changes = engine.reconfigure({"kv_host_memory": block_bytes * 16})
    assert [(c.old, c.new) for c in changes] == [(block_bytes * 64, block_bytes * 16)]
    assert (tier.capacity, store.flat.num_live_blocks) == (16, 16)          # the memory went back
    assert engine.make_stats().kv_cache.host.num_blocks == 16
    # Whole segments: 20 blocks' worth is 24 blocks.
    engine.reconfigure({"kv_host_memory": block_bytes * 20})
    assert tier.capacity == 24 and engine.runtime_config()["kv_host_memory"] == block_bytes * 24
    # Blocks written after the change stay within it.
    for index in range(6):
        _run(engine, _prompt(20 + index, 5 * BLOCK + 1), request_id=f"w{index}")
    engine.reconfigure({"kv_host_memory": f"{block_bytes * 64}B"})              # a size as the flag takes it
    assert (tier.capacity, store.flat.num_live_blocks) == (64, 64)


@pytest.mark.parametrize("size,message", [
    (0, r"^kv_host_memory 0 would turn the host KV tier off"),
    ("1GiB", r"^kv_host_memory of 1073741824 bytes exceeds the \d+ bytes the host KV tier allocated at start"),
    (100, r"^kv_host_memory of 100 bytes holds no KV block"),
    (-5, r"^kv_host_memory must be >= 0 bytes"),
    ("lots", r"^kv_host_memory must be a number of bytes or a size"),
    (None, r"^kv_host_memory needs a value"),
])
def test_host_tier_sizes_it_cannot_take_are_refused(folder, block_bytes, size, message):
    engine = _engine(folder, kv_host_memory=block_bytes * 64)
    with pytest.raises(ValueError, match=message):
        engine.reconfigure({"kv_host_memory": size})
    assert engine.kv_manager.host_tier.capacity == 64


def test_without_a_host_tier_its_size_cannot_change(folder):
    with pytest.raises(ValueError, match="^kv_host_memory: the host KV tier is off"):
        _engine(folder, kv_host_memory=0).reconfigure({"kv_host_memory": 1 << 20})


def test_memory_pressure_resizes_are_auto_events_and_respect_the_operators_size(folder, block_bytes, tmp_path):
    engine = _engine(folder, kv_host_memory=block_bytes * 64, kv_host_memory_pressure=20.0)
    psi = tmp_path / "proc" / "pressure" / "memory"
    psi.parent.mkdir(parents=True)
    psi.write_text("some avg10=50.00 avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")
    engine.host_pressure = PressureMonitor(str(tmp_path), cgroup_dir="", use_meminfo=False, min_interval_s=0.0)
    engine.host_sizer.shrink_cooldown_s = engine.host_sizer.grow_hold_s = 0.0
    _run(engine, _prompt(9, 40), max_tokens=4)
    tier = engine.kv_manager.host_tier
    assert tier.capacity < 64
    auto = [e for e in engine.make_stats().config_events if e.source == "auto"]
    assert auto and all(e.field == "kv_host_memory" for e in auto)
    assert auto[0].old == str(block_bytes * 64) and auto[-1].new == str(tier.capacity * block_bytes)
    assert engine.make_stats().runtime_config.changes["kv_host_memory"]["auto"] == len(auto)
    # The operator's size is what calm grows back to, not the size allocated at start.
    engine.reconfigure({"kv_host_memory": block_bytes * 32})
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")
    for index in range(12):
        _run(engine, _prompt(30 + index, 20), max_tokens=2, request_id=f"calm{index}")
    assert tier.capacity == 32
    assert engine.runtime_config()["kv_host_memory"] == block_bytes * 32


# --- all or nothing, types, events -----------------------------------------------------------------
def test_a_refused_change_applies_none_of_the_others(folder):
    engine = _engine(folder)
    before = engine.runtime_config()
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens must be >= 1, got 0"):
        engine.reconfigure({"eviction_policy": "lru-k", "lru_k": 3, "slo_tpot": 0.5, "max_num_batched_tokens": 0})
    assert engine.runtime_config() == before
    assert engine.scheduler.slo is None and engine.make_stats().prefix_cache.active_policy == "lru"
    assert engine.make_stats().config_events == ()


@pytest.mark.parametrize("changes,message", [
    ({"lru_k": 9}, r"^lru_k must be in \[1, 8\], got 9"),
    ({"lru_k": "3"}, r"^lru_k must be an integer, got '3'"),
    ({"lru_k": 2.5}, r"^lru_k must be an integer"),
    ({"lru_k": True}, r"^lru_k must be an integer"),
    ({"lru_k": None}, r"^lru_k needs a value"),
    ({"heat_half_life_s": 0}, r"^heat_half_life_s must be > 0, got 0"),
    ({"eviction_policy": "mru"}, r"^eviction_policy must be one of \('lru', 'lru-k'"),
    ({"slo_ttft": -1}, r"^slo_ttft must be > 0 seconds"),
    ({"slo_tpot": "fast"}, r"^slo_tpot must be a number"),
    ({"max_num_batched_tokens": None}, r"^max_num_batched_tokens needs a value"),
    ({"block_size": 8}, r"^block_size cannot change at run time \(restart with --block-size\)"),
    ({"colour": "blue"}, r"^colour is not an engine setting"),
])
def test_each_value_is_checked_as_its_flag_is(folder, changes, message):
    engine = _engine(folder)
    with pytest.raises(ValueError, match=message):
        engine.reconfigure(changes)


def test_changes_are_events_logged_with_old_and_new_values(folder, caplog):
    engine = _engine(folder)
    with caplog.at_level("INFO", logger="kvserve"):
        changes = engine.reconfigure({"lru_k": 4, "slo_ttft": 2.5, "eviction_policy": "lru"})   # lru: unchanged
    assert [(c.field, c.old, c.new) for c in changes] == [("lru_k", 2, 4), ("slo_ttft", None, 2.5)]
    assert "config change (admin): lru_k 2 -> 4" in caplog.text
    assert "config change (admin): slo_ttft none -> 2.5" in caplog.text
    stats = engine.make_stats()
    assert [(e.source, e.field, e.old, e.new) for e in stats.config_events] == [
        ("admin", "lru_k", "2", "4"), ("admin", "slo_ttft", "none", "2.5")]
    assert stats.runtime_config.values["lru_k"] == 4 and stats.runtime_config.values["slo_ttft"] == 2.5
    assert stats.runtime_config.choices == {"eviction_policy": "lru", "kv_press": "none", "kv_press_mode": "drop"}
    # The ring keeps the latest events; the counts keep every change.
    for index in range(EVENT_HISTORY + 6):
        engine.reconfigure({"lru_k": 2 + index % 2})
    stats = engine.make_stats()
    assert len(stats.config_events) == EVENT_HISTORY and stats.config_events[-1].new == str(2 + (EVENT_HISTORY + 5) % 2)
    assert stats.runtime_config.changes["lru_k"] == {"admin": EVENT_HISTORY + 7}


def test_the_adaptive_policys_arm_switches_are_events(folder):
    """A scan of one-off blocks between reuses of a few hot ones: lru (the first arm) loses them
    every round, lru-k keeps them, so the policy switches, and each switch is an "adaptive" event."""
    engine = _engine(folder, eviction_policy="lru")
    engine.reconfigure({"eviction_policy": "adaptive"})
    cache = engine.kv_manager.prefix_cache
    capacity = engine.kv_manager.num_blocks
    hot = [bytes([1, i]) * 8 for i in range(4)]
    now, fresh = 0.0, 0
    for _ in range(12):
        for block in hot:
            now += 0.001
            cache.observe_lookup([block], now)
        for _ in range(2 * capacity):
            now += 0.001
            fresh += 1
            cache.observe_lookup([fresh.to_bytes(16, "little")], now)
    adaptive = engine.make_stats().prefix_cache.adaptive
    assert adaptive.num_switches >= 1 and adaptive.active != "lru"
    events = [e for e in engine.make_stats().config_events if e.source == "adaptive"]
    assert len(events) == adaptive.num_switches
    assert events[0].field == "eviction_policy" and events[0].old == "lru" and events[-1].new == adaptive.active
    assert engine.make_stats().runtime_config.changes["eviction_policy"] == {"admin": 1,
                                                                               "adaptive": adaptive.num_switches}

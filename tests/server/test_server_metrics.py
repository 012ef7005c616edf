"""Stats as data: /metrics is rendered from the EngineSnapshot alone (made from Engine.make_stats()'s
kvserve/stats.py dataclasses: the prefix cache, the MoE expert load, the latency targets), and the
engine's parts fill those fields."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve.engine.async_engine import EngineSnapshot
from kvserve.obs.metrics import (COLD_TIER_METRIC_NAMES, HOST_TIER_METRIC_NAMES, METRIC_NAMES, MOE_METRIC_NAMES,
                                 ServerMetrics)
from kvserve.stats import (AdaptivePolicyStats, ColdStoreStats, EngineStats, ExpertLoadStats, HostTierStats, KVCacheStats,
                           LatencyTargetStats, PrefixCacheStats, SchedulerStats, TransferStats)


def _samples(text: str) -> dict[str, float]:
    """'name{labels}' -> value, for every sample line."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^(\S+?(?:\{[^}]*\})?) (\S+)$", line)
        if match and not line.startswith("#"):
            found[match.group(1)] = float(match.group(2))
    return found


def _stats(**fields) -> EngineStats:
    return EngineStats(SchedulerStats(2, 1, 3), KVCacheStats(100, 60, 0.4, 1600), 50, 20, {"stop": 4}, **fields)


PREFIX = PrefixCacheStats("adaptive", "lru", lookups=5, query_tokens=200, hit_tokens=50, cached_blocks=12,
                          evictable_blocks=7, pinned_blocks=2, num_pins=1, evictions={"lru": 3},
                          adaptive=AdaptivePolicyStats("lru", 4, {"lru": 0.5, "lfu": 0.25}))
LOAD = ExpertLoadStats(layers=(1, 2), tokens_per_expert=((3, 1, 0, 0), (1, 1, 1, 1)), top_k=2)


def test_metrics_render_the_snapshots_stats_dataclasses():
    snapshot = EngineSnapshot.from_stats(_stats(prefix_cache=PREFIX, expert_load=LOAD, decode_kv_bytes_total=4096),
                                         num_steps=9, num_step_errors=1, rejected_by_gate=0)
    assert snapshot.prefix_cache is PREFIX and snapshot.expert_load is LOAD
    text = ServerMetrics(lambda: snapshot, "m").render().decode()
    for name in METRIC_NAMES + MOE_METRIC_NAMES:
        assert name in text, name
    samples = _samples(text)
    assert samples['kvserve:num_requests_running{model_name="m"}'] == 2
    assert samples['kvserve:kv_cache_blocks_used{model_name="m"}'] == 40
    assert samples['kvserve:decode_kv_bytes_total{model_name="m"}'] == 4096
    assert samples['kvserve:prefix_cache_queries_total{model_name="m"}'] == 200
    assert samples['kvserve:prefix_cache_hits_total{model_name="m"}'] == 50
    assert samples['kvserve:prefix_cache_hit_rate{model_name="m"}'] == 0.25
    assert samples['kvserve:prefix_cache_pinned_blocks{model_name="m"}'] == 2
    assert samples['kvserve:prefix_cache_evictions_total{model_name="m",policy="lru"}'] == 3
    assert samples['kvserve:prefix_cache_policy_info{active="lru",model_name="m",policy="adaptive"}'] == 1
    assert samples['kvserve:prefix_cache_adaptive_switches_total{model_name="m"}'] == 4
    assert samples['kvserve:prefix_cache_adaptive_shadow_hit_rate{arm="lfu",model_name="m"}'] == 0.25
    assert samples['kvserve:moe_expert_tokens_total{expert="0",layer="1",model_name="m"}'] == 3
    assert samples['kvserve:moe_expert_imbalance{layer="1",model_name="m"}'] == 3.0
    assert samples['kvserve:moe_expert_imbalance{layer="2",model_name="m"}'] == 1.0


def test_without_those_stats_their_series_are_absent():
    text = ServerMetrics(lambda: EngineSnapshot.from_stats(_stats(), 0, 0, 0), "m").render().decode()
    assert "kvserve:num_requests_running" in text
    assert "prefix_cache" not in text and "moe_expert" not in text and "slo_" not in text


def test_the_latency_targets_are_stats_too():
    latency = LatencyTargetStats(4, 0.02, 1, 2, None, 512, ttft_target_s=1.5, tpot_target_s=None)
    stats = EngineStats(SchedulerStats(0, 0, 0, latency), KVCacheStats(1, 1, 0.0, 16), 0, 0)
    snapshot = EngineSnapshot.from_stats(stats, 0, 0, rejected_by_gate=3)
    assert (snapshot.slo_max_running, snapshot.slo_rejected_at_arrival) == (4, 4)
    from kvserve.engine.client import ServedModel
    from kvserve.server.app import _slo_targets
    served = ServedModel(model=None, load_format="auto", source_path="m", max_model_len=64, vocab_size=10,
                         max_num_seqs=4, capacity_tokens=64, slo_ttft_s=1.5)
    targets = _slo_targets(served)
    assert (targets.ttft_s, targets.tpot_s) == (1.5, None)
    assert _slo_targets(ServedModel(None, "auto", "m", 64, 10, 4, 64)) is None
    text = ServerMetrics(lambda: snapshot, "m", slo=targets).render().decode()
    assert 'kvserve:requests_slo_total{model_name="m",outcome="met"} 0.0' in text


# --------------------------------------------------------------------------------------------------
# the owners fill them
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-metrics-llama")
    build_tiny_checkpoint("llama", folder)
    return str(folder)


def _engine(folder: str, **options):
    from kvserve.engine.engine import Engine
    return Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=2 << 20,
                               block_size=16, max_model_len=256, **options)


def test_engine_make_stats_carries_the_prefix_cache_and_the_targets(tiny_llama):
    from kvserve.sampling_params import SamplingParams
    engine = _engine(tiny_llama, slo_ttft=2.0, slo_tpot=0.5)
    prompt = list(range(5, 5 + 40))
    for request_id in ("a", "b"):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
    stats = engine.make_stats()
    published = engine.prefix.stats          # what the prefix-cache control publishes itself
    assert stats.prefix_cache.hit_tokens == published.hit_tokens > 0
    assert (stats.prefix_cache.query_tokens, stats.prefix_cache.cached_blocks, stats.prefix_cache.policy) == \
        (published.query_tokens, published.cached_blocks, published.policy)
    assert stats.expert_load is None          # a dense model
    assert (stats.scheduler.latency.ttft_target_s, stats.scheduler.latency.tpot_target_s) == (2.0, 0.5)
    off = _engine(tiny_llama, enable_prefix_caching=False).make_stats()
    assert (off.prefix_cache.policy, off.prefix_cache.query_tokens) == ("off", 0)
    assert off.scheduler.latency is None


def test_the_expert_load_is_read_at_most_once_a_second_while_requests_run():
    from kvserve.engine.engine import Engine
    reads = []

    def expert_load():
        reads.append(1)
        return SimpleNamespace(layers=[1], tokens_per_expert=[[len(reads), 0]], top_k=1)

    engine = SimpleNamespace(_groups={"r": None}, expert_load=expert_load, _expert_load_read=None,
                             _expert_load_read_at=float("-inf"), EXPERT_LOAD_READ_INTERVAL_S=60.0)
    first = Engine._expert_load_stats(engine)
    assert first == ExpertLoadStats((1,), ((1, 0),), 1)
    assert Engine._expert_load_stats(engine) is first and len(reads) == 1     # busy: the last read
    engine._groups = {}
    assert Engine._expert_load_stats(engine).tokens_per_expert == ((2, 0),)   # idle: read now


def test_host_tier_metrics_come_from_the_kv_cache_stats():
    host = HostTierStats(num_blocks=64, used_blocks=10, hit_tokens=40, blocks_written=12, blocks_loaded=10,
                         blocks_evicted=2, writes_dropped=1, swapped_out=3, swapped_in=2, swap_failures=1)
    transfers = TransferStats(bytes_to_device=4096, bytes_to_host=8192, loads=3, load_seconds=0.03,
                              load_buckets=((0.001, 1), (0.01, 1), (0.1, 0)), write_back_blocks_dropped=2, copy_failures=1)
    stats = EngineStats(SchedulerStats(2, 1, 3), KVCacheStats(100, 60, 0.4, 1600, host, transfers), 50, 20,
                        {"stop": 4})
    snapshot = EngineSnapshot.from_stats(stats, num_steps=9, num_step_errors=0, rejected_by_gate=0)
    samples = _samples(ServerMetrics(lambda: snapshot, "m").render().decode())
    assert samples['kvserve:kv_host_blocks_total{model_name="m"}'] == 64
    assert samples['kvserve:kv_host_blocks_used{model_name="m"}'] == 10
    assert samples['kvserve:kv_host_hit_tokens_total{model_name="m"}'] == 40
    assert samples['kvserve:kv_host_blocks_moved_total{direction="to_host",model_name="m"}'] == 12
    assert samples['kvserve:kv_host_blocks_moved_total{direction="to_device",model_name="m"}'] == 10
    assert samples['kvserve:kv_host_blocks_evicted_total{model_name="m"}'] == 2
    assert samples['kvserve:kv_host_writes_dropped_total{model_name="m"}'] == 1 + 2
    assert samples['kvserve:kv_host_bytes_moved_total{direction="to_device",model_name="m"}'] == 4096
    assert samples['kvserve:kv_host_bytes_moved_total{direction="to_host",model_name="m"}'] == 8192
    assert samples['kvserve:kv_host_load_seconds_bucket{le="0.001",model_name="m"}'] == 1
    assert samples['kvserve:kv_host_load_seconds_bucket{le="0.1",model_name="m"}'] == 2
    assert samples['kvserve:kv_host_load_seconds_bucket{le="+Inf",model_name="m"}'] == 3
    assert samples['kvserve:kv_host_load_seconds_count{model_name="m"}'] == 3
    assert samples['kvserve:kv_host_load_seconds_sum{model_name="m"}'] == 0.03
    assert samples['kvserve:kv_host_copy_failures_total{model_name="m"}'] == 1
    assert samples['kvserve:kv_host_swaps_total{event="out",model_name="m"}'] == 3
    assert samples['kvserve:kv_host_swaps_total{event="failed",model_name="m"}'] == 1
    without = EngineSnapshot.from_stats(_stats(), num_steps=9, num_step_errors=0, rejected_by_gate=0)
    text = ServerMetrics(lambda: without, "m").render().decode()
    assert not any(name in text for name in HOST_TIER_METRIC_NAMES)


def test_cold_tier_metrics_come_from_the_kv_cache_stats():
    disk = ColdStoreStats("disk", True, entries=11, used_bytes=3500, capacity_bytes=1 << 20, hits=10, misses=2,
                          bytes_read=3200, bytes_written=3500, blocks_written=11, writes_dropped=1, evictions=4,
                          corrupt=1, errors=0)
    remote = ColdStoreStats("remote", False, entries=5, used_bytes=1600, capacity_bytes=0, hits=3, misses=7,
                            errors=2, writes_dropped=6)
    kv = KVCacheStats(100, 60, 0.4, 1600, cold=(disk, remote), cold_writes_dropped=9,
                      cold_hit_tokens={"disk": 40, "remote": 12}, cold_prefetches={"found": 3, "timed_out": 1})
    stats = EngineStats(SchedulerStats(2, 1, 3), kv, 50, 20, {"stop": 4})
    snapshot = EngineSnapshot.from_stats(stats, num_steps=9, num_step_errors=0, rejected_by_gate=0)
    text = ServerMetrics(lambda: snapshot, "m").render().decode()
    samples = _samples(text)
    assert all(name in text for name in COLD_TIER_METRIC_NAMES)
    assert samples['kvserve:kv_tier_available{model_name="m",tier="disk"}'] == 1
    assert samples['kvserve:kv_tier_available{model_name="m",tier="remote"}'] == 0
    assert samples['kvserve:kv_tier_blocks{model_name="m",tier="disk"}'] == 11
    assert samples['kvserve:kv_tier_capacity_bytes{model_name="m",tier="disk"}'] == 1 << 20
    assert samples['kvserve:kv_tier_hit_tokens_total{model_name="m",tier="disk"}'] == 40
    assert samples['kvserve:kv_tier_hit_tokens_total{model_name="m",tier="remote"}'] == 12
    assert samples['kvserve:kv_tier_lookups_total{model_name="m",result="miss",tier="remote"}'] == 7
    assert samples['kvserve:kv_tier_bytes_total{direction="read",model_name="m",tier="disk"}'] == 3200
    assert samples['kvserve:kv_tier_writes_dropped_total{model_name="m",tier="remote"}'] == 6
    assert samples['kvserve:kv_tier_evictions_total{model_name="m",tier="disk"}'] == 4
    assert samples['kvserve:kv_tier_corrupt_total{model_name="m",tier="disk"}'] == 1
    assert samples['kvserve:kv_tier_errors_total{model_name="m",tier="remote"}'] == 2
    assert samples['kvserve:kv_tier_write_queue_dropped_total{model_name="m"}'] == 9
    assert samples['kvserve:kv_tier_prefetches_total{model_name="m",outcome="found"}'] == 3
    assert samples['kvserve:kv_tier_prefetches_total{model_name="m",outcome="timed_out"}'] == 1
    assert samples['kvserve:kv_tier_prefetches_total{model_name="m",outcome="missed"}'] == 0
    without = EngineSnapshot.from_stats(_stats(), num_steps=9, num_step_errors=0, rejected_by_gate=0)
    text = ServerMetrics(lambda: without, "m").render().decode()
    assert not any(name in text for name in COLD_TIER_METRIC_NAMES)


def test_press_metrics_come_from_the_press_stats():
    from kvserve.obs.metrics import PRESS_METRIC_NAMES
    from kvserve.stats import PressStats
    stats = _stats(presses=(PressStats("snapkv", applied=3, skipped=1, tokens_pruned=900, blocks_freed=55,
                                       tokens_demoted=320, tokens_recalled=48),))
    snapshot = EngineSnapshot.from_stats(stats, num_steps=9, num_step_errors=0, rejected_by_gate=0)
    text = ServerMetrics(lambda: snapshot, "m").render().decode()
    samples = _samples(text)
    assert all(name in text for name in PRESS_METRIC_NAMES)
    assert samples['kvserve:kv_press_requests_total{model_name="m",outcome="applied",press="snapkv"}'] == 3
    assert samples['kvserve:kv_press_requests_total{model_name="m",outcome="skipped",press="snapkv"}'] == 1
    assert samples['kvserve:kv_press_tokens_pruned_total{model_name="m",press="snapkv"}'] == 900
    assert samples['kvserve:kv_press_blocks_freed_total{model_name="m",press="snapkv"}'] == 55
    assert samples['kvserve:kv_press_tokens_demoted_total{model_name="m",press="snapkv"}'] == 320
    assert samples['kvserve:kv_press_tokens_recalled_total{model_name="m",press="snapkv"}'] == 48
    without = EngineSnapshot.from_stats(_stats(), num_steps=9, num_step_errors=0, rejected_by_gate=0)
    assert not any(name in ServerMetrics(lambda: without, "m").render().decode() for name in PRESS_METRIC_NAMES)


def test_tenant_labels_are_bounded_and_the_kv_gauge_sums_by_label():
    from kvserve.obs.metrics import TenantLabels
    label = TenantLabels(limit=2)
    assert [label(t) for t in ("a", None, "b", "a", "c")] == ["a", "none", "other", "a", "other"]
    stats = _stats()
    stats = EngineStats(SchedulerStats(2, 1, 3, kv_blocks_by_tenant={"a": 5, None: 2}, kv_quotas={"a": (9, 12)}),
                        stats.kv_cache, 50, 20, {"stop": 4})
    snapshot = EngineSnapshot.from_stats(stats, num_steps=9, num_step_errors=0, rejected_by_gate=0)
    samples = _samples(ServerMetrics(lambda: snapshot, "m").render().decode())
    assert samples['kvserve:tenant_kv_blocks{model_name="m",tenant="a"}'] == 5
    assert samples['kvserve:tenant_kv_blocks{model_name="m",tenant="none"}'] == 2
    assert samples['kvserve:tenant_kv_resident_blocks{model_name="m",tenant="a"}'] == 9
    assert samples['kvserve:tenant_kv_quota_blocks{model_name="m",tenant="a"}'] == 12
    from kvserve.server.usage import usage_summary
    row = next(row for row in usage_summary(snapshot)["data"] if row["tenant"] == "a")
    assert (row["kv_resident_blocks"], row["kv_quota_blocks"]) == (9, 12)


def test_tenant_totals_come_from_the_engines_usage_and_share_the_label_cap():
    """The per-tenant request and token series are the snapshot's TenantUsage (the engine's count,
    which /v1/usage reads too); tenants past the cap are summed under "other"."""
    from kvserve.obs.metrics import MAX_TENANT_LABELS
    from kvserve.stats import TenantUsage
    usage = {None: TenantUsage({"stop": 2}, 30, 16, 9)}
    usage.update({f"t{i:02d}": TenantUsage({"length": 1, "abort": i % 2}, 10 + i, 0, 4)
                  for i in range(MAX_TENANT_LABELS + 2)})
    snapshot = EngineSnapshot.from_stats(_stats(tenant_usage=usage), num_steps=9, num_step_errors=0,
                                         rejected_by_gate=0)
    samples = _samples(ServerMetrics(lambda: snapshot, "m").render().decode())
    assert samples['kvserve:tenant_requests_total{finished_reason="stop",model_name="m",tenant="none"}'] == 2
    assert samples['kvserve:tenant_cached_prompt_tokens_total{model_name="m",tenant="none"}'] == 16
    assert samples['kvserve:tenant_prompt_tokens_total{model_name="m",tenant="t05"}'] == 15
    assert samples['kvserve:tenant_generation_tokens_total{model_name="m",tenant="t05"}'] == 4
    # "none" and t00..t62 take the 64 labels; t63, t64 and t65 share "other".
    assert samples['kvserve:tenant_prompt_tokens_total{model_name="m",tenant="other"}'] == 73 + 74 + 75
    assert samples['kvserve:tenant_requests_total{finished_reason="abort",model_name="m",tenant="other"}'] == 2
    assert not any('tenant="t63"' in name for name in samples)

"""--vllm-metric-aliases (kvserve/obs/vllm_aliases.py): /metrics repeats the series that mean the same
as vLLM's under their `vllm:` names, with the kvserve series' values, labels, type and buckets; without
the flag no `vllm:` name appears. Rendered from a snapshot (every aliased family present), from a
real server's /metrics (the flag through ServerConfig), and in multiprocess mode."""

from __future__ import annotations

import re

import pytest

from conftest import requires_default_model
from kvserve.engine.async_engine import EngineSnapshot
from kvserve.obs.metrics import (COLD_TIER_METRIC_NAMES, HOST_TIER_METRIC_NAMES, METRIC_NAMES, MOE_METRIC_NAMES,
                                 PRESS_METRIC_NAMES, SLO_METRIC_NAMES, TENANT_METRIC_NAMES, ServerMetrics)
from kvserve.obs.vllm_aliases import VLLM_ALIASES
from kvserve.stats import EngineStats, KVCacheStats, PrefixCacheStats, SchedulerStats

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})? (\S+)$")


def _samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, labels) -> value, for every sample line."""
    found = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            found[(match.group(1), match.group(2) or "")] = float(match.group(3))
    return found


def _types(text: str) -> dict[str, str]:
    """Exposed name -> type, from the `# TYPE` lines (a counter's carries its `_total`)."""
    return dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))


def _series(samples: dict, exposed: str, kind: str) -> dict[tuple[str, str], float]:
    """A family's samples keyed by (suffix, labels): _bucket/_sum/_count/_created or the bare name."""
    base = exposed[:-len("_total")] if kind == "counter" else exposed
    return {(name[len(base):], labels): value for (name, labels), value in samples.items()
            if name.startswith(base) and name[len(base):] in ("", "_total", "_bucket", "_sum", "_count", "_created")}


def _metrics(**options) -> ServerMetrics:
    from kvserve.engine.client import FinishedRequest
    prefix = PrefixCacheStats("lru", "lru", lookups=5, query_tokens=200, hit_tokens=50, cached_blocks=12,
                              evictable_blocks=7, pinned_blocks=2, num_pins=0, evictions={"lru": 3})
    stats = EngineStats(SchedulerStats(2, 1, 3), KVCacheStats(100, 60, 0.4, 1600), 50, 20, {"stop": 4},
                        prefix_cache=prefix)
    snapshot = EngineSnapshot.from_stats(stats, num_steps=9, num_step_errors=0, rejected_by_gate=0)
    metrics = ServerMetrics(lambda: snapshot, "m", **options)
    metrics.observe_finished(FinishedRequest("r", "stop", arrival_time=10.0, first_scheduled_time=10.01,
                                             first_token_time=10.05, finished_time=10.35, num_prompt_tokens=12,
                                             num_generation_tokens=4, max_sample_tokens=4))
    return metrics


def test_every_alias_source_is_a_kvserve_metric_and_every_target_a_vllm_name():
    ours = set(METRIC_NAMES + SLO_METRIC_NAMES + HOST_TIER_METRIC_NAMES + COLD_TIER_METRIC_NAMES
               + PRESS_METRIC_NAMES + MOE_METRIC_NAMES + TENANT_METRIC_NAMES)
    assert set(VLLM_ALIASES) <= ours, set(VLLM_ALIASES) - ours
    targets = [name for names in VLLM_ALIASES.values() for name in names]
    assert len(targets) == len(set(targets)), "two kvserve series under one vLLM name"
    assert all(name.startswith("vllm:") for name in targets)
    # A counter stays a counter: its vLLM name keeps the `_total` that /metrics shows.
    for source, names in VLLM_ALIASES.items():
        assert all(name.endswith("_total") == source.endswith("_total") for name in names), (source, names)


def test_with_the_flag_each_alias_repeats_its_series():
    text = _metrics(vllm_aliases=True).render().decode()
    samples, types = _samples(text), _types(text)
    for source, names in VLLM_ALIASES.items():
        kind = types[source]
        ours = _series(samples, source, kind)
        assert ours, source
        for alias in names:
            assert types[alias] == kind, alias
            assert _series(samples, alias, kind) == ours, alias   # same suffixes, labels (le too), values
    # The figures the fixture set, read under vLLM's names.
    assert samples[("vllm:num_requests_running", '{model_name="m"}')] == 2
    assert samples[("vllm:kv_cache_usage_perc", '{model_name="m"}')] == 0.4
    assert samples[("vllm:gpu_cache_usage_perc", '{model_name="m"}')] == 0.4
    assert samples[("vllm:prefix_cache_hits_total", '{model_name="m"}')] == 50
    assert samples[("vllm:time_to_first_token_seconds_count", '{model_name="m"}')] == 1
    assert samples[("vllm:request_time_per_output_token_seconds_sum", '{model_name="m"}')] == pytest.approx(0.1)
    assert samples[("vllm:request_success_total", '{finished_reason="stop",model_name="m"}')] == 1


def test_without_the_flag_no_vllm_name_appears():
    text = _metrics().render().decode()
    assert "vllm:" not in text
    assert "kvserve:kv_cache_usage_perc" in text


def test_multiprocess_front_ends_alias_the_summed_request_series():
    """With several front ends the request histograms are families that prometheus_client's
    MultiProcessCollector builds from its files: they are renamed the same way."""
    from prometheus_client.core import HistogramMetricFamily
    from kvserve.obs.vllm_aliases import VLLMAliasedRegistry

    class Files:
        def collect(self):
            family = HistogramMetricFamily("kvserve:e2e_request_latency_seconds", "e2e", labels=["model_name"])
            family.add_metric(["m"], [("1.0", 2), ("+Inf", 3)], sum_value=4.5)
            yield family

    families = list(VLLMAliasedRegistry(Files()).collect())
    assert [f.name for f in families] == ["kvserve:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"]
    assert [(s.name, s.labels, s.value) for s in families[1].samples] == [
        (s.name.replace("kvserve:", "vllm:"), s.labels, s.value) for s in families[0].samples]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from loopback_server import build_tiny_chat_model
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-aliases"), max_position_embeddings=512)


@pytest.mark.slow
@requires_default_model          # the tiny model borrows its tokenizer
@pytest.mark.parametrize("flag", [True, False])
def test_a_servers_metrics_follow_the_flag(tiny_model, flag):
    import httpx
    from kvserve.engine.engine import Engine
    from loopback_server import LoopbackServer
    server = LoopbackServer(Engine.from_options(model=tiny_model, max_model_len=256, kv_cache_memory=4 << 20),
                            vllm_metric_aliases=flag)
    try:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 3,
                                                                    "temperature": 0, "ignore_eos": True}, timeout=60)
        assert response.status_code == 200, response.text
        samples = _samples(httpx.get(server.url + "/metrics", timeout=10).text)
    finally:
        server.stop()
    labels = '{model_name="tiny"}'
    assert samples[("kvserve:generation_tokens_total", labels)] == 3
    if flag:
        assert samples[("vllm:generation_tokens_total", labels)] == 3
        assert samples[("vllm:e2e_request_latency_seconds_count", labels)] == 1
        assert samples[("vllm:kv_cache_usage_perc", labels)] == samples[("kvserve:kv_cache_usage_perc", labels)]
    else:
        assert not any(name.startswith("vllm:") for name, _ in samples)

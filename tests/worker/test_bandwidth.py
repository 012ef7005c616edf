"""Bytes per step against the measured copy bandwidth (kvserve/worker/bandwidth.py): the weights a
forward reads, the KV its attention reads, the engine's per-step accounting, and /metrics."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.bandwidth import (UTILIZATION_BUCKETS, BandwidthMeter, WeightProfile, measure_copy_bandwidth,
                                      weight_profile)


def test_copy_bandwidth_is_measured_once_per_device():
    rate, how = measure_copy_bandwidth("cpu")
    assert rate > 1e8 and "cpu copy" in how
    assert measure_copy_bandwidth("cpu") == (rate, how)      # cached: one measurement per process


def test_weight_profile_leaves_out_an_untied_embedding_and_counts_a_tied_one_once(tiny_checkpoint):
    """Against the checkpoint's own parameters (transformers' model), counted in the engine's
    dtype: the CPU path repacks the linear weights into buffers of the same size."""
    folder, hf_model = tiny_checkpoint
    engine = LLM(folder, enforce_eager=True, kv_cache_memory=1 << 20).engine
    model, element = engine.model, torch.tensor([], dtype=engine.dtype).element_size()
    total = sum(p.numel() for p in hf_model.parameters()) * element      # a tied matrix is listed once
    embedding = hf_model.get_input_embeddings().weight.numel() * element
    profile = weight_profile(model)
    if hf_model.config.tie_word_embeddings:
        assert profile.dense_bytes == total                 # the LM head reads the shared matrix whole
    else:
        assert profile.dense_bytes == total - embedding     # only the tokens' rows of the input embedding
    assert profile.bytes_for_tokens(1) == profile.bytes_for_tokens(64) == profile.dense_bytes


def test_moe_layers_read_the_experts_their_tokens_are_routed_to():
    profile = WeightProfile(dense_bytes=1000, moe_layers=((64, 6, 10),))
    assert profile.bytes_for_tokens(1) == 1000 + 6 * 10               # one token: its top-k experts
    assert profile.bytes_for_tokens(4096) == 1000 + 64 * 10           # a big batch: every expert
    assert profile.bytes_for_tokens(1) < profile.bytes_for_tokens(8) < profile.bytes_for_tokens(64)


def test_meter_histogram_and_recent_gauge():
    meter = BandwidthMeter(WeightProfile(100), kv_bytes_per_token=2, peak_bytes_per_s=1000.0, peak_source="test")
    assert meter.make_stats() is None                                 # nothing measured yet
    assert meter.observe(500, 1.0, now=10.0) == pytest.approx(0.5)
    assert meter.observe(1500, 1.0, now=10.5) == pytest.approx(1.5)
    stats = meter.make_stats()
    assert stats.steps == 2 and stats.bytes_read_total == 2000 and stats.seconds_total == pytest.approx(2.0)
    counts = dict(stats.utilization_buckets)
    assert counts[0.5] == 1 and counts[1.5] == 1 and sum(counts.values()) == 2
    assert stats.utilization_sum == pytest.approx(2.0)
    assert meter.recent_utilization() == pytest.approx(1.0)           # both steps within the last second
    meter.observe(100, 1.0, now=12.0)                                  # the first two fall out of the window
    assert meter.recent_utilization() == pytest.approx(0.1)
    assert len(stats.utilization_buckets) == len(UTILIZATION_BUCKETS)


def test_engine_counts_weights_and_the_kv_each_step_reads(tiny_checkpoint):
    """One request of P prompt tokens and N outputs without chunking: a prefill step that reads the
    weights and P tokens' KV, then N - 1 decode steps reading the weights and P + i tokens' KV."""
    folder, _ = tiny_checkpoint
    llm = LLM(folder, enforce_eager=True, async_scheduling="off", kv_cache_memory=1 << 20)
    engine = llm.engine
    prompt, new = list(range(3, 40)), 6
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    stats = engine.make_stats().bandwidth
    weights = weight_profile(engine.model).dense_bytes
    kv_tokens = len(prompt) + sum(len(prompt) + i for i in range(1, new))
    assert stats.steps == new
    assert stats.bytes_read_total == new * weights + engine.kv_bytes_per_token * kv_tokens
    assert stats.weight_bytes_per_step == weights
    assert stats.peak_bytes_per_s == measure_copy_bandwidth(str(engine.device))[0]
    assert stats.last_bytes_read == weights + engine.kv_bytes_per_token * (len(prompt) + new - 1)
    assert 0 < stats.seconds_total and 0 < stats.recent_utilization


def test_bandwidth_metrics_are_exported(tiny_checkpoint):
    from kvserve.engine.client import EngineSnapshot
    from kvserve.obs.metrics import BANDWIDTH_METRIC_NAMES, ServerMetrics
    folder, _ = tiny_checkpoint
    llm = LLM(folder, enforce_eager=True, kv_cache_memory=1 << 20)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    snapshot = EngineSnapshot.from_stats(llm.engine.make_stats(), 3, 0, 0)
    text = ServerMetrics(lambda: snapshot, "m").render().decode()
    for name in BANDWIDTH_METRIC_NAMES:
        assert name in text
    from prometheus_client.parser import text_string_to_metric_families
    samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples}
    stats = snapshot.bandwidth
    assert samples["kvserve:step_bytes_read_total"] == stats.bytes_read_total
    assert samples["kvserve:hbm_bandwidth_utilization_per_step_count"] == stats.steps == 3
    assert samples["kvserve:hbm_bandwidth_utilization"] == pytest.approx(stats.recent_utilization)

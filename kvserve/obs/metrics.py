"""Prometheus metrics for the server, in the `kvserve:` namespace (named the way vLLM dashboards
name theirs, with `kvserve:` for `vllm:`).

Two kinds of series:
- engine state (requests running/waiting, KV blocks, token and preemption totals, the per-tenant
  request and token totals, the prefix cache, the MoE expert load, the latency controls) is read
  from the latest `EngineSnapshot` (made from `Engine.make_stats()`'s kvserve/stats.py
  dataclasses) at scrape time by custom collectors, so it is never stale and never touches the
  engine from the HTTP thread;
- per-request latencies (TTFT, time per output token, end-to-end, queue time) and sizes are
  histograms observed when a request leaves the engine (`observe_finished`, called on the engine
  thread; prometheus_client metrics are thread-safe).

Each `ServerMetrics` has its own CollectorRegistry, so several servers (tests) can live in one
process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvserve.engine.client import EngineSnapshot, FinishedRequest
from kvserve.stats import BandwidthStats, ExpertLoadStats, TenantUsage, tenant_sort_key

if TYPE_CHECKING:
    from kvserve.sched.slo import SLOTargets

NAMESPACE = "kvserve"
CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# The names /metrics exposes (docs/server.md lists them; tests check they are all present).
METRIC_NAMES = (
    f"{NAMESPACE}:num_requests_running",
    f"{NAMESPACE}:num_requests_waiting",
    f"{NAMESPACE}:kv_cache_usage_perc",
    f"{NAMESPACE}:kv_cache_blocks_total",
    f"{NAMESPACE}:kv_cache_blocks_used",
    f"{NAMESPACE}:kv_cache_capacity_tokens",
    f"{NAMESPACE}:prompt_tokens_total",
    f"{NAMESPACE}:generation_tokens_total",
    f"{NAMESPACE}:decode_kv_bytes_total",
    f"{NAMESPACE}:num_preemptions_total",
    f"{NAMESPACE}:engine_steps_total",
    f"{NAMESPACE}:engine_step_errors_total",
    f"{NAMESPACE}:request_success_total",
    f"{NAMESPACE}:time_to_first_token_seconds",
    f"{NAMESPACE}:time_per_output_token_seconds",
    f"{NAMESPACE}:e2e_request_latency_seconds",
    f"{NAMESPACE}:request_queue_time_seconds",
    f"{NAMESPACE}:request_prompt_tokens",
    f"{NAMESPACE}:request_generation_tokens",
    f"{NAMESPACE}:http_request_errors_total",
    f"{NAMESPACE}:prefix_cache_queries_total",
    f"{NAMESPACE}:prefix_cache_hits_total",
    f"{NAMESPACE}:prefix_cache_hit_rate",
    f"{NAMESPACE}:prefix_cache_evictions_total",
    f"{NAMESPACE}:prefix_cache_blocks",
    f"{NAMESPACE}:prefix_cache_evictable_blocks",
    f"{NAMESPACE}:prefix_cache_pinned_blocks",
    f"{NAMESPACE}:prefix_cache_policy_info",
    # Run-time reconfiguration (the admin config API; engine/runtime_config.py).
    f"{NAMESPACE}:config_changes_total",
    f"{NAMESPACE}:config_value",
    f"{NAMESPACE}:config_info",
)
# Present only with latency targets (--slo-ttft / --slo-tpot; docs/slo_scheduling.md).
SLO_METRIC_NAMES = (
    f"{NAMESPACE}:slo_max_running_requests",
    f"{NAMESPACE}:slo_step_time_seconds",
    f"{NAMESPACE}:slo_step_token_budget",
    f"{NAMESPACE}:slo_step_cost_seconds",
    f"{NAMESPACE}:requests_shed_total",
    f"{NAMESPACE}:requests_slo_total",
)
# Outcomes of requests_slo_total: a finished request met every set target, or missed these.
SLO_OUTCOMES = ("met", "missed_ttft", "missed_tpot", "missed_both")
# Present only with a host KV tier (--kv-host-memory; docs/kv_tiers.md).
HOST_TIER_METRIC_NAMES = (
    f"{NAMESPACE}:kv_host_blocks_total",
    f"{NAMESPACE}:kv_host_blocks_used",
    f"{NAMESPACE}:kv_host_hit_tokens_total",
    f"{NAMESPACE}:kv_host_blocks_moved_total",
    f"{NAMESPACE}:kv_host_blocks_evicted_total",
    f"{NAMESPACE}:kv_host_writes_dropped_total",
    f"{NAMESPACE}:kv_host_swaps_total",
    f"{NAMESPACE}:kv_host_bytes_moved_total",
    f"{NAMESPACE}:kv_host_load_seconds",
    f"{NAMESPACE}:kv_host_copy_failures_total",
    f"{NAMESPACE}:kv_host_loads_joined_total",
    f"{NAMESPACE}:kv_host_loads_inline_total",
)
# Present only with a disk or remote KV tier (--kv-disk-path, --kv-remote-url; docs/kv_tiers.md),
# one series per tier (label `tier`: disk, remote).
COLD_TIER_METRIC_NAMES = (
    f"{NAMESPACE}:kv_tier_available",
    f"{NAMESPACE}:kv_tier_blocks",
    f"{NAMESPACE}:kv_tier_bytes_used",
    f"{NAMESPACE}:kv_tier_capacity_bytes",
    f"{NAMESPACE}:kv_tier_hit_tokens_total",
    f"{NAMESPACE}:kv_tier_lookups_total",
    f"{NAMESPACE}:kv_tier_bytes_total",
    f"{NAMESPACE}:kv_tier_blocks_written_total",
    f"{NAMESPACE}:kv_tier_writes_dropped_total",
    f"{NAMESPACE}:kv_tier_write_queue_dropped_total",
    f"{NAMESPACE}:kv_tier_prefetches_total",
    f"{NAMESPACE}:kv_tier_evictions_total",
    f"{NAMESPACE}:kv_tier_corrupt_total",
    f"{NAMESPACE}:kv_tier_errors_total",
)
# Present once a KV press has run (--kv-press or a request's kv_press; docs/kv_compression.md), one
# series per press (label `press`).
PRESS_METRIC_NAMES = (
    f"{NAMESPACE}:kv_press_requests_total",
    f"{NAMESPACE}:kv_press_tokens_pruned_total",
    f"{NAMESPACE}:kv_press_blocks_freed_total",
    f"{NAMESPACE}:kv_press_tokens_demoted_total",
    f"{NAMESPACE}:kv_press_tokens_recalled_total",
)
# Present once the engine has run a step (docs/observability.md#bandwidth).
BANDWIDTH_METRIC_NAMES = (
    f"{NAMESPACE}:hbm_bandwidth_utilization",
    f"{NAMESPACE}:memory_bandwidth_peak_bytes_per_second",
    f"{NAMESPACE}:hbm_bandwidth_utilization_per_step",
    f"{NAMESPACE}:step_bytes_read_total",
    f"{NAMESPACE}:step_seconds_total",
)
# Present only for MoE models (DeepSeek-V2/V3; docs/deepseek.md).
MOE_METRIC_NAMES = (
    f"{NAMESPACE}:moe_expert_tokens_total",
    f"{NAMESPACE}:moe_expert_imbalance",
)


def _cold_tier_metrics(snap: EngineSnapshot, labels: list[str], values: list[str]) -> Iterable[Metric]:
    """One series per disk / remote KV tier (label `tier`)."""
    tier_labels = labels + ["tier"]

    def family(kind: type, name: str, doc: str, value_of: Callable, extra: str = "") -> Metric:
        metric = kind(f"{NAMESPACE}:{name}", doc, labels=tier_labels + ([extra] if extra else []))
        for stats in snap.kv_cold:
            for label, value in value_of(stats):
                metric.add_metric(values + [stats.name] + ([label] if extra else []), value)
        return metric

    yield family(GaugeMetricFamily, "kv_tier_available", "1 while the tier answers and takes writes (0: the remote "
                 "server is down, or the disk is full).", lambda t: [("", float(t.available))])
    yield family(GaugeMetricFamily, "kv_tier_blocks", "KV blocks the tier holds (as far as this process knows).",
                 lambda t: [("", t.entries)])
    yield family(GaugeMetricFamily, "kv_tier_bytes_used", "Bytes the tier's blocks take (as far as this process "
                 "knows).", lambda t: [("", t.used_bytes)])
    yield family(GaugeMetricFamily, "kv_tier_capacity_bytes", "The tier's size cap (0: bounded by the store "
                 "itself, e.g. Redis maxmemory).", lambda t: [("", t.capacity_bytes)])
    yield family(CounterMetricFamily, "kv_tier_hit_tokens", "Prompt tokens loaded from the tier (checked) instead "
                 "of computed.", lambda t: [("", snap.kv_cold_hit_tokens.get(t.name, 0))])
    yield family(CounterMetricFamily, "kv_tier_lookups", "Blocks looked up in the tier, by result (hit: read; its "
                 "checks are counted in kv_tier_corrupt).", lambda t: [("hit", t.hits), ("miss", t.misses)], "result")
    yield family(CounterMetricFamily, "kv_tier_bytes", "Bytes read from and written to the tier.",
                 lambda t: [("read", t.bytes_read), ("written", t.bytes_written)], "direction")
    yield family(CounterMetricFamily, "kv_tier_blocks_written", "KV blocks written to the tier.",
                 lambda t: [("", t.blocks_written)])
    yield family(CounterMetricFamily, "kv_tier_writes_dropped", "Blocks the tier did not write: full, down, or "
                 "over the tenant's quota.", lambda t: [("", t.writes_dropped)])
    queue = CounterMetricFamily(f"{NAMESPACE}:kv_tier_write_queue_dropped", "Blocks not sent to the disk / remote "
                                "tiers at all: their write queue was full.", labels=labels)
    queue.add_metric(values, snap.kv_cold_writes_dropped)
    yield queue
    prefetches = CounterMetricFamily(f"{NAMESPACE}:kv_tier_prefetches", "Prefix lookups in the disk / remote "
                                     "tiers on a request's arrival, by outcome: found (blocks came up), missed, "
                                     "timed_out (the request stopped waiting: a slow tier), skipped (reading "
                                     "measured slower than computing).", labels=labels + ["outcome"])
    for outcome in ("found", "missed", "timed_out", "skipped"):
        prefetches.add_metric(values + [outcome], snap.kv_cold_prefetches.get(outcome, 0))
    yield prefetches
    yield family(CounterMetricFamily, "kv_tier_evictions", "Blocks this process removed to stay under the size cap.",
                 lambda t: [("", t.evictions)])
    yield family(CounterMetricFamily, "kv_tier_corrupt", "Stored blocks that failed their checks (checksum, header, "
                 "identity): misses, removed.", lambda t: [("", t.corrupt)])
    yield family(CounterMetricFamily, "kv_tier_errors", "I/O or connection errors of the tier (each a miss or a "
                 "dropped write).", lambda t: [("", t.errors)])


def _tenant_usage_metrics(usage: dict[Optional[str], TenantUsage], label_of: "TenantLabels", labels: list[str],
                          values: list[str]) -> Iterable[Metric]:
    """The engine's per-tenant totals (its TenantUsage, the one count of them), summed by label:
    tenants past the label cap share "other"."""
    names = labels + ["tenant"]
    requests = CounterMetricFamily(f"{NAMESPACE}:tenant_requests", "Requests that left the engine, by tenant and "
                                   "reason.", labels=names + ["finished_reason"])
    prompt = CounterMetricFamily(f"{NAMESPACE}:tenant_prompt_tokens", "Prompt tokens of the requests that left the "
                                 "engine, by tenant (once per request).", labels=names)
    cached = CounterMetricFamily(f"{NAMESPACE}:tenant_cached_prompt_tokens", "Of those, the prompt tokens whose KV "
                                 "came from the prefix cache or a KV tier, by tenant.", labels=names)
    generation = CounterMetricFamily(f"{NAMESPACE}:tenant_generation_tokens", "Tokens generated for the requests "
                                     "that left the engine, by tenant.", labels=names)
    by_label: dict[str, TenantUsage] = {}
    for tenant, totals in sorted(usage.items(), key=lambda item: tenant_sort_key(item[0])):
        label = label_of(tenant)
        by_label[label] = by_label[label].merged(totals) if label in by_label else totals
    for label, totals in sorted(by_label.items()):
        for reason, count in sorted(totals.requests.items()):
            requests.add_metric(values + [label, reason], count)
        prompt.add_metric(values + [label], totals.prompt_tokens)
        cached.add_metric(values + [label], totals.cached_prompt_tokens)
        generation.add_metric(values + [label], totals.generation_tokens)
    yield from (requests, prompt, cached, generation)


def _cumulative(per_bucket: Iterable[tuple[float, int]]) -> list[tuple[str, int]]:
    """(upper bound, count in that bucket alone) pairs as a Prometheus histogram's cumulative buckets."""
    cumulative, buckets = 0, []
    for bound, count in per_bucket:
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return buckets


def _bandwidth_metrics(bw: BandwidthStats, labels: list[str], values: list[str]) -> Iterable[Metric]:
    """Memory bandwidth per step (kvserve/worker/bandwidth.py): weights + KV read over the step's time,
    as a fraction of the copy bandwidth measured at start."""
    gauge = GaugeMetricFamily(f"{NAMESPACE}:hbm_bandwidth_utilization", "Bytes the engine's steps of the last "
                              "second read (weights + KV) over their time, as a fraction of the measured copy "
                              "bandwidth (memory_bandwidth_peak_bytes_per_second).", labels=labels)
    gauge.add_metric(values, bw.recent_utilization)
    yield gauge
    peak = GaugeMetricFamily(f"{NAMESPACE}:memory_bandwidth_peak_bytes_per_second", "Copy bandwidth of the engine's "
                             "device (read + write), measured once at start.", labels=labels + ["how"])
    peak.add_metric(values + [bw.peak_source], bw.peak_bytes_per_s)
    yield peak
    histogram = HistogramMetricFamily(f"{NAMESPACE}:hbm_bandwidth_utilization_per_step", "Each engine step's bytes "
                                      "read over its time, as a fraction of the measured copy bandwidth.",
                                      labels=labels)
    histogram.add_metric(values, _cumulative(bw.utilization_buckets), sum_value=bw.utilization_sum)
    yield histogram
    read = CounterMetricFamily(f"{NAMESPACE}:step_bytes_read", "Bytes the engine's steps read: the weights each "
                               "forward reads (by their stored dtype; a MoE layer's routed experts) plus the KV "
                               "its attention read (in the cache's format).", labels=labels)
    read.add_metric(values, bw.bytes_read_total)
    yield read
    seconds = CounterMetricFamily(f"{NAMESPACE}:step_seconds", "The measured steps' summed time "
                                  "(step_bytes_read over it: the mean read rate).", labels=labels)
    seconds.add_metric(values, bw.seconds_total)
    yield seconds


def _runtime_config_metrics(snap: EngineSnapshot, labels: list[str], values: list[str]) -> Iterable[Metric]:
    """The reconfigurable settings now and their changes (always rendered: empty before the engine's
    first snapshot). Fields are the engine's settings and the configured classes: a bounded set."""
    changes = CounterMetricFamily(f"{NAMESPACE}:config_changes", "Run-time changes of an engine setting, by "
                                  "field and source (admin: the admin config API; adaptive: the adaptive eviction "
                                  "policy switching arm; auto: memory pressure resizing the host KV tier).",
                                  labels=labels + ["field", "source"])
    value = GaugeMetricFamily(f"{NAMESPACE}:config_value", "The numeric engine settings the admin config API may "
                              "change, as the engine uses them now (unset ones absent).", labels=labels + ["field"])
    info = GaugeMetricFamily(f"{NAMESPACE}:config_info", "The named engine settings the admin config API may "
                             "change (1 for the value in force).", labels=labels + ["field", "value"])
    config = snap.runtime_config
    if config is not None:
        for field, by_source in sorted(config.changes.items()):
            for source, count in sorted(by_source.items()):
                changes.add_metric(values + [field, source], count)
        for field, number in sorted(config.values.items()):
            value.add_metric(values + [field], number)
        for field, choice in sorted(config.choices.items()):
            info.add_metric(values + [field, choice], 1)
    yield from (changes, value, info)


def _press_metrics(snap: EngineSnapshot, labels: list[str], values: list[str]) -> Iterable[Metric]:
    requests = CounterMetricFamily(f"{NAMESPACE}:kv_press_requests", "Requests a KV press pruned (outcome applied) "
                                   "or left whole (skipped: too short, or keeping everything).",
                                   labels=labels + ["press", "outcome"])
    tokens = CounterMetricFamily(f"{NAMESPACE}:kv_press_tokens_pruned", "KV tokens presses removed (per layer and "
                                 "KV head: each drops the same count).", labels=labels + ["press"])
    blocks = CounterMetricFamily(f"{NAMESPACE}:kv_press_blocks_freed", "KV blocks presses gave back to the pool.",
                                 labels=labels + ["press"])
    demoted = CounterMetricFamily(f"{NAMESPACE}:kv_press_tokens_demoted", "KV tokens the tier press mode moved "
                                  "off the GPU to the host tier (per layer and KV head).", labels=labels + ["press"])
    recalled = CounterMetricFamily(f"{NAMESPACE}:kv_press_tokens_recalled", "KV tokens the tier press mode brought "
                                   "back from the host tier as the decode's queries ranked them high.",
                                   labels=labels + ["press"])
    for press in snap.presses:
        demoted.add_metric(values + [press.press], press.tokens_demoted)
        recalled.add_metric(values + [press.press], press.tokens_recalled)
        requests.add_metric(values + [press.press, "applied"], press.applied)
        requests.add_metric(values + [press.press, "skipped"], press.skipped)
        tokens.add_metric(values + [press.press], press.tokens_pruned)
        blocks.add_metric(values + [press.press], press.blocks_freed)
    yield from (requests, tokens, blocks, demoted, recalled)


# Per-tenant series: tenants come from API keys (a bounded set), but with --trust-request-tenant a
# gateway names them; past this many distinct tenants the rest share the label "other".
MAX_TENANT_LABELS = 64
NO_TENANT = "none"
TENANT_METRIC_NAMES = (
    f"{NAMESPACE}:tenant_requests_total",
    f"{NAMESPACE}:tenant_prompt_tokens_total",
    f"{NAMESPACE}:tenant_cached_prompt_tokens_total",
    f"{NAMESPACE}:tenant_generation_tokens_total",
    f"{NAMESPACE}:tenant_time_to_first_token_seconds",
    f"{NAMESPACE}:tenant_kv_blocks",
    f"{NAMESPACE}:tenant_kv_resident_blocks",
    f"{NAMESPACE}:tenant_kv_quota_blocks",
)


class TenantLabels:
    """The label a tenant's series carry: its name, "none" without one, "other" past the cap."""

    def __init__(self, limit: int = MAX_TENANT_LABELS) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, tenant: Optional[str]) -> str:
        name = NO_TENANT if tenant is None else tenant
        if name in self._seen:
            return name
        if len(self._seen) >= self.limit:
            return "other"
        self._seen.add(name)
        return name


class _EngineStateCollector:
    """Turns the latest engine snapshot into gauges and counters at scrape time."""

    @staticmethod
    def _class_families(snap: EngineSnapshot, labels: list[str], values: list[str]) -> Iterable[Metric]:
        """Request classes (--qos-config): measured p99s, counts, and whether a class holds the
        lower ones back. The class names come from the config file: a bounded label set."""
        if not snap.qos_classes:
            return
        names = labels + ["qos_class"]
        p99 = GaugeMetricFamily(f"{NAMESPACE}:qos_class_latency_p99_seconds", "Measured p99 TTFT and TPOT of each "
                                "request class over its recent window (absent with too few samples).",
                                labels=names + ["metric"])
        target = GaugeMetricFamily(f"{NAMESPACE}:qos_class_latency_target_seconds", "Each request class's p99 "
                                   "targets.", labels=names + ["metric"])
        holding = GaugeMetricFamily(f"{NAMESPACE}:qos_class_holding", "1 while the class misses a p99 target with "
                                    "work pending, so lower classes are not admitted.", labels=names)
        counts = CounterMetricFamily(f"{NAMESPACE}:qos_class_requests", "Requests of each class that finished, "
                                     "finished within its targets, or were shed (503).", labels=names + ["outcome"])
        kv = GaugeMetricFamily(f"{NAMESPACE}:qos_class_kv_blocks", "GPU KV blocks of each class: held by its running "
                               "requests, and reserved for it (--qos-config).", labels=names + ["kind"])
        for cls in snap.qos_classes:
            row = values + [cls.name]
            for metric, measured, goal in (("ttft", cls.ttft_p99_s, cls.ttft_target_s),
                                           ("tpot", cls.tpot_p99_s, cls.tpot_target_s)):
                if measured is not None:
                    p99.add_metric(row + [metric], measured)
                if goal is not None:
                    target.add_metric(row + [metric], goal)
            holding.add_metric(row, 1.0 if cls.holding_lower_classes else 0.0)
            for outcome, value in (("finished", cls.requests_finished), ("met_targets", cls.requests_met),
                                   ("shed", cls.requests_shed)):
                counts.add_metric(row + [outcome], value)
            kv.add_metric(row + ["held"], cls.kv_blocks)
            kv.add_metric(row + ["reserved"], cls.kv_reserved_blocks)
        yield from (p99, target, holding, counts, kv)

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str, tenant_label: TenantLabels) -> None:
        self._snapshot = snapshot
        self._model_name = model_name
        self._tenant_label = tenant_label

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        labels, values = ["model_name"], [self._model_name]
        if snap.tenant_usage:
            yield from _tenant_usage_metrics(snap.tenant_usage, self._tenant_label, labels, values)
        if snap.kv_blocks_by_tenant:
            family = GaugeMetricFamily(f"{NAMESPACE}:tenant_kv_blocks", "GPU KV blocks held by each tenant's "
                                       "running and loading requests.", labels=labels + ["tenant"])
            totals: dict[str, int] = {}
            for tenant, blocks in snap.kv_blocks_by_tenant.items():
                label = self._tenant_label(tenant)
                totals[label] = totals.get(label, 0) + blocks
            for label, blocks in sorted(totals.items()):
                family.add_metric(values + [label], blocks)
            yield family
        if snap.kv_quotas:      # tenants named in --qos-config: a bounded set
            resident = GaugeMetricFamily(f"{NAMESPACE}:tenant_kv_resident_blocks", "GPU KV blocks a tenant with a "
                                         "KV quota holds: running and cached.", labels=labels + ["tenant"])
            quota = GaugeMetricFamily(f"{NAMESPACE}:tenant_kv_quota_blocks", "The tenant's KV quota (--qos-config).",
                                      labels=labels + ["tenant"])
            for tenant, (blocks, limit) in sorted(snap.kv_quotas.items()):
                resident.add_metric(values + [tenant], blocks)
                quota.add_metric(values + [tenant], limit)
            yield resident
            yield quota

        yield from self._class_families(snap, labels, values)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{NAMESPACE}:{name}", doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{NAMESPACE}:{name}", doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", snap.num_running)
        yield gauge("num_requests_waiting", "Requests queued, preempted, or loading their KV from a tier: "
                    "waiting to run.", snap.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", snap.kv_usage)
        yield gauge("kv_cache_blocks_total", "KV cache blocks in the pool.", snap.num_blocks)
        yield gauge("kv_cache_blocks_used", "KV cache blocks held by requests.", snap.num_used_blocks)
        yield gauge("kv_cache_capacity_tokens", "Tokens the KV cache holds.", snap.capacity_tokens)
        host = snap.kv_host
        if host is not None:
            yield gauge("kv_host_blocks_total", "Blocks of the host KV tier.", host.num_blocks)
            yield gauge("kv_host_blocks_used", "Host KV blocks holding a cached block.", host.used_blocks)
            yield counter("kv_host_hit_tokens", "Prompt tokens loaded from the host KV tier instead of computed.",
                          host.hit_tokens)
            moved = CounterMetricFamily(f"{NAMESPACE}:kv_host_blocks_moved", "KV blocks copied between the GPU "
                                        "and the host tier, by direction.", labels=labels + ["direction"])
            moved.add_metric(values + ["to_host"], host.blocks_written)
            moved.add_metric(values + ["to_device"], host.blocks_loaded)
            yield moved
            yield counter("kv_host_blocks_evicted", "Host KV blocks reused for newer blocks.", host.blocks_evicted)
            yield counter("kv_host_loads_joined", "Requests whose prefix reached host blocks another request was "
                          "loading: they waited for that load and hit the GPU cache instead of loading the blocks again.",
                          host.loads_joined)
            transfers = snap.kv_transfers
            yield counter("kv_host_writes_dropped", "Blocks not written back to the host tier (every host block was being "
                          "read that step, or too many write-back bytes were in flight).",
                          host.writes_dropped + (transfers.write_back_blocks_dropped if transfers is not None else 0))
            if transfers is not None:
                moved_bytes = CounterMetricFamily(f"{NAMESPACE}:kv_host_bytes_moved", "Bytes copied between the GPU "
                                                  "and the host tier, by direction.", labels=labels + ["direction"])
                moved_bytes.add_metric(values + ["to_host"], transfers.bytes_to_host)
                moved_bytes.add_metric(values + ["to_device"], transfers.bytes_to_device)
                yield moved_bytes
                loads = HistogramMetricFamily(f"{NAMESPACE}:kv_host_load_seconds", "Time of each load or swap-in from "
                                              "the host tier (on a GPU, between CUDA events of the copy).",
                                              labels=labels)
                buckets = _cumulative(transfers.load_buckets) + [("+Inf", transfers.loads)]
                loads.add_metric(values, buckets, transfers.load_seconds)
                yield loads
                yield counter("kv_host_copy_failures", "Copies to or from the host tier that failed (a load "
                              "or swap recomputes its request, a write-back is forgotten).",
                              transfers.copy_failures)
                yield counter("kv_host_loads_inline", "Loads from the host tier run inline in the step that "
                              "admitted their request (its forward waited for the copy; --kv-host-inline-load-ms) "
                              "rather than beside the running steps.", transfers.loads_inline)
            swaps = CounterMetricFamily(f"{NAMESPACE}:kv_host_swaps", "Swap preemption: requests whose KV went to "
                                        "the host tier (out), came back (in), or recomputed for lack of room (failed).",
                                        labels=labels + ["event"])
            for event, value in (("out", host.swapped_out), ("in", host.swapped_in), ("failed", host.swap_failures)):
                swaps.add_metric(values + [event], value)
            yield swaps
        if snap.kv_cold:
            yield from _cold_tier_metrics(snap, labels, values)
        if snap.presses:
            yield from _press_metrics(snap, labels, values)
        if snap.bandwidth is not None:
            yield from _bandwidth_metrics(snap.bandwidth, labels, values)
        yield counter("prompt_tokens", "Prompt tokens admitted (times n samples).", snap.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", snap.generation_tokens_total)
        yield counter("decode_kv_bytes", "KV bytes decode attention read: each decoding request's KV length (shorter "
                      "once pressed or tiered) times its format's bytes per token, summed over steps; over "
                      "engine_steps_total, the KV bytes per step.", snap.decode_kv_bytes_total)
        yield counter("num_preemptions", "Requests preempted (KV freed, recomputed later).",
                      snap.num_preemptions_total)
        yield counter("engine_steps", "Engine steps run.", snap.num_steps_total)
        yield counter("engine_step_errors", "Engine steps that raised (their requests got an error).",
                      snap.num_step_errors_total)
        if snap.slo_max_running is not None:
            yield gauge("slo_max_running_requests", "Running requests allowed under the TPOT target.",
                        snap.slo_max_running)
            yield gauge("slo_step_time_seconds", "Smoothed engine step time the running limit is held by.",
                        snap.slo_step_time_s or 0.0)
            if snap.slo_step_token_budget is not None:
                yield gauge("slo_step_token_budget", "Tokens the next step may hold under the latency targets.",
                            snap.slo_step_token_budget)
            if snap.slo_step_cost is not None:
                cost = GaugeMetricFamily(f"{NAMESPACE}:slo_step_cost_seconds", "Step-cost model: seconds of a step "
                                         "= fixed + per_token x tokens + per_sequence x sequences.",
                                         labels=labels + ["term"])
                for term, value in (("fixed", snap.slo_step_cost.fixed_s), ("per_token", snap.slo_step_cost.per_token_s),
                                    ("per_sequence", snap.slo_step_cost.per_sequence_s)):
                    cost.add_metric(values + [term], value)
                yield cost
            shed = CounterMetricFamily(f"{NAMESPACE}:requests_shed", "Requests rejected (HTTP 503) because they "
                                       "could not start within the TTFT target, by where.", labels=labels + ["where"])
            shed.add_metric(values + ["arrival"], snap.slo_rejected_at_arrival)
            shed.add_metric(values + ["queue"], snap.slo_rejected_in_queue)
            yield shed
        yield from _runtime_config_metrics(snap, labels, values)


class _PrefixCacheCollector:
    """Prefix-cache series from the snapshot's PrefixCacheStats (none without one)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self._snapshot().prefix_cache
        if stats is None:
            return
        name, model = f"{NAMESPACE}:prefix_cache_", self._model_name

        def family(kind: type, suffix: str, doc: str, value: float) -> Metric:
            metric = kind(name + suffix, doc, labels=["model_name"])
            metric.add_metric([model], value)
            return metric

        yield family(CounterMetricFamily, "queries", "Prompt tokens looked up in the prefix cache.", stats.query_tokens)
        yield family(CounterMetricFamily, "hits", "Prompt tokens served from the prefix cache.", stats.hit_tokens)
        yield family(GaugeMetricFamily, "hit_rate", "Prefix-cache hits / queries (tokens) since start.", stats.hit_rate)
        yield family(GaugeMetricFamily, "blocks", "KV blocks addressable by prefix hash (in use or evictable).",
                     stats.cached_blocks)
        yield family(GaugeMetricFamily, "evictable_blocks", "Cached blocks no request holds (counted as free).",
                     stats.evictable_blocks)
        yield family(GaugeMetricFamily, "pinned_blocks", "Cached blocks under an active pin.", stats.pinned_blocks)
        evictions = CounterMetricFamily(name + "evictions", "Cached blocks evicted, by the policy that chose them.",
                                        labels=["model_name", "policy"])
        for policy, count in sorted({stats.active_policy: 0, **stats.evictions}.items()):
            evictions.add_metric([model, policy], count)
        yield evictions
        # Which policy ranks blocks now (1) and, for adaptive, how each arm's shadow cache scores.
        info = GaugeMetricFamily(name + "policy_info", "Eviction policy configured (policy) and in force (active).",
                                 labels=["model_name", "policy", "active"])
        info.add_metric([model, stats.policy, stats.active_policy], 1)
        yield info
        if stats.adaptive is not None:
            yield family(CounterMetricFamily, "adaptive_switches", "Times the adaptive policy changed arm.",
                         stats.adaptive.num_switches)
            shadow = GaugeMetricFamily(name + "adaptive_shadow_hit_rate",
                                       "Discounted hit rate of each adaptive arm's shadow cache (blocks).",
                                       labels=["model_name", "arm"])
            for arm, rate in stats.adaptive.shadow_hit_rates.items():
                shadow.add_metric([model, arm], rate)
            yield shadow


class _ExpertLoadCollector:
    """Tokens routed to each expert of each MoE layer, and each layer's imbalance (busiest expert's
    load over the mean), from the snapshot's ExpertLoadStats (none for a model without MoE layers)."""

    def __init__(self, expert_load: Callable[[], Optional[ExpertLoadStats]], model_name: str) -> None:
        self._expert_load = expert_load
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self._expert_load()
        if stats is None:
            return
        tokens = CounterMetricFamily(f"{NAMESPACE}:moe_expert_tokens",
                                     "Tokens routed to an expert (each token counts for each of its top-k experts).",
                                     labels=["model_name", "layer", "expert"])
        imbalance = GaugeMetricFamily(f"{NAMESPACE}:moe_expert_imbalance",
                                      "Busiest expert's tokens over the mean per expert, per MoE layer (1 = even).",
                                      labels=["model_name", "layer"])
        for layer, counts, ratio in zip(stats.layers, stats.tokens_per_expert, stats.imbalance()):
            for expert, count in enumerate(counts):
                tokens.add_metric([self._model_name, str(layer), str(expert)], count)
            imbalance.add_metric([self._model_name, str(layer)], ratio)
        yield tokens
        yield imbalance


class ServerMetrics:
    """/metrics of one server. `snapshot` gives the latest EngineSnapshot (read at scrape time);
    `slo` the latency targets at start: finished requests are judged by those the engine holds when
    they finish (the snapshot's, which the admin config API may change), these until its first
    snapshot; `expert_load`, where given, is read instead of the snapshot's expert load
    (for a caller with an engine but no engine thread)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str,
                 slo: Optional["SLOTargets"] = None,
                 expert_load: Optional[Callable[[], Optional[ExpertLoadStats]]] = None,
                 multiprocess_dir: Optional[str] = None, vllm_aliases: bool = False) -> None:
        self.model_name = model_name
        # --vllm-metric-aliases: render also repeats the series vLLM names the same (obs/vllm_aliases.py).
        self.vllm_aliases = vllm_aliases
        self.slo = slo if slo is not None and slo.enabled else None
        self._snapshot = snapshot
        self.registry = CollectorRegistry(auto_describe=True)
        # One label map for every per-tenant series, so that a tenant past the cap is "other" in all.
        self._tenant_label = TenantLabels()
        self.registry.register(_EngineStateCollector(snapshot, model_name, self._tenant_label))
        self.registry.register(_PrefixCacheCollector(snapshot, model_name))
        self.registry.register(_ExpertLoadCollector(expert_load or (lambda: snapshot().expert_load), model_name))
        # Several front ends (--api-server-count): each process writes its request counters and
        # histograms to files in multiprocess_dir (prometheus_client's multiprocess mode, chosen by
        # PROMETHEUS_MULTIPROC_DIR before it is imported), and any of them renders the sum; the
        # engine gauges come from the core's snapshot, the same in every front end.
        request_registry = self.registry
        if multiprocess_dir is not None:
            from prometheus_client import multiprocess
            request_registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, namespace="", buckets=buckets,
                             registry=request_registry).labels(model_name)

        self.ttft = histogram(f"{NAMESPACE}:time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.", _TTFT_BUCKETS)
        self.tpot = histogram(f"{NAMESPACE}:time_per_output_token_seconds",
                              "Mean time between generated tokens of a request, after the first.",
                              _TPOT_BUCKETS)
        self.e2e = histogram(f"{NAMESPACE}:e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", _E2E_BUCKETS)
        self.queue_time = histogram(f"{NAMESPACE}:request_queue_time_seconds",
                                    "Time from request arrival to its first scheduling.", _TTFT_BUCKETS)
        self.prompt_tokens = histogram(f"{NAMESPACE}:request_prompt_tokens",
                                       "Prompt length of finished requests.", _TOKEN_BUCKETS)
        self.generation_tokens = histogram(f"{NAMESPACE}:request_generation_tokens",
                                           "Tokens generated by finished requests (all samples).",
                                           _TOKEN_BUCKETS)
        self._success = Counter(f"{NAMESPACE}:request_success", "Requests that left the engine, by reason.",
                                labels + ["finished_reason"], registry=request_registry)
        self._http_errors = Counter(f"{NAMESPACE}:http_request_errors",
                                    "Requests answered with an error object, by status code.",
                                    labels + ["status_code"], registry=request_registry)
        for reason in ("stop", "length", "abort", "rejected", "error"):
            self._success.labels(model_name, reason)
        # The per-tenant request and token totals come from the engine's snapshot (_tenant_usage_metrics);
        # the TTFT histogram is observed here, where each request's times arrive.
        tenant_labels = labels + ["tenant"]
        self._tenant_ttft = Histogram(f"{NAMESPACE}:tenant_time_to_first_token_seconds", "Time from arrival to "
                                      "the first token, by tenant.", tenant_labels, namespace="",
                                      buckets=_TTFT_BUCKETS, registry=request_registry)
        self._request_registry = request_registry
        self._slo_outcomes: Optional[Counter] = None
        if self.slo is not None:
            self._slo_counter()

    def _slo_counter(self) -> Counter:
        """Server-side goodput: the rate of outcome="met" is requests served within every target.
        Made when there first are targets (at start, or once the admin config API sets one)."""
        if self._slo_outcomes is None:
            self._slo_outcomes = Counter(f"{NAMESPACE}:requests_slo",
                                         "Finished requests (stop or length) by whether they met the latency "
                                         "targets (--slo-ttft, --slo-tpot) in force when they finished.",
                                         ["model_name", "outcome"], registry=self._request_registry)
            for outcome in SLO_OUTCOMES:
                self._slo_outcomes.labels(self.model_name, outcome)
        return self._slo_outcomes

    def _slo_targets_now(self) -> tuple[Optional[float], Optional[float]]:
        """(TTFT, TPOT) targets as the engine holds them now (the admin config API may have changed
        them since start); before the engine's first snapshot, those given at start."""
        snap = self._snapshot()
        if snap.slo_max_running is not None:            # the engine's latency controller runs
            return snap.slo_ttft_target_s, snap.slo_tpot_target_s
        if snap.runtime_config is not None:             # an engine without targets now
            return None, None
        return (self.slo.ttft_s, self.slo.tpot_s) if self.slo is not None else (None, None)

    def observe_finished(self, info: FinishedRequest) -> None:
        self._success.labels(self.model_name, info.finish_reason).inc()
        if info.finish_reason in ("stop", "length") and info.first_token_time is not None:
            self._tenant_ttft.labels(self.model_name, self._tenant_label(info.tenant)).observe(
                max(0.0, info.first_token_time - info.arrival_time))
        if info.finish_reason not in ("stop", "length"):
            return   # aborted/failed requests would skew the latency histograms
        self.e2e.observe(max(0.0, info.finished_time - info.arrival_time))
        if info.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, info.first_scheduled_time - info.arrival_time))
        if info.first_token_time is not None:
            self.ttft.observe(max(0.0, info.first_token_time - info.arrival_time))
            if info.max_sample_tokens > 1:
                self.tpot.observe(max(0.0, info.finished_time - info.first_token_time)
                                  / (info.max_sample_tokens - 1))
        self.prompt_tokens.observe(info.num_prompt_tokens)
        self.generation_tokens.observe(info.num_generation_tokens)
        ttft_s, tpot_s = self._slo_targets_now()
        if ttft_s is not None or tpot_s is not None:
            self._slo_counter().labels(self.model_name, self._slo_outcome(info, ttft_s, tpot_s)).inc()

    @staticmethod
    def _slo_outcome(info: FinishedRequest, ttft_s: Optional[float], tpot_s: Optional[float]) -> str:
        """TTFT from arrival; TPOT as the histogram's (one token: no TPOT to miss)."""
        first = info.first_token_time if info.first_token_time is not None else info.finished_time
        ttft_missed = ttft_s is not None and first - info.arrival_time > ttft_s
        tpot_missed = (tpot_s is not None and info.max_sample_tokens > 1
                       and (info.finished_time - first) / (info.max_sample_tokens - 1) > tpot_s)
        if ttft_missed and tpot_missed:
            return "missed_both"
        return "missed_ttft" if ttft_missed else "missed_tpot" if tpot_missed else "met"

    def count_error(self, status_code: int) -> None:
        self._http_errors.labels(self.model_name, str(status_code)).inc()

    def render(self) -> bytes:
        if self.vllm_aliases:
            from kvserve.obs.vllm_aliases import VLLMAliasedRegistry
            return generate_latest(VLLMAliasedRegistry(self.registry))
        return generate_latest(self.registry)

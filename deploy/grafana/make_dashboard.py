"""Writes kvserve-dashboard.json, the Grafana dashboard over kvserve's /metrics (deploy/README.md).

The panels are listed here once, as (title, unit, [(PromQL, legend)]), and the JSON is generated, so
every query carries the same `model_name` / `instance` filter and the layout stays consistent.
After editing, run `python deploy/grafana/make_dashboard.py`; tests/deploy checks the JSON matches.

Series that exist only with a feature on (host / disk / remote tier, latency targets, tenants, a
prefix cache) leave their panels empty without it: "No data" there means the feature is off.
"""

from __future__ import annotations

import json
import os
from typing import Optional

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Every query's filter: the dashboard's model and instance choices (both "All" by default).
FILTER = 'model_name=~"$model_name",instance=~"$instance"'
RATE = "$__rate_interval"
HIT = 'result="hit"'


def s(name: str, extra: str = "") -> str:
    """A selector of `name` under the dashboard's filter (plus `extra` label matchers)."""
    return f"{name}{{{FILTER}{',' + extra if extra else ''}}}"


def rate(name: str, extra: str = "", by: str = "") -> str:
    """Per-second rate summed over instances (by `by` labels)."""
    return f"sum{f' by ({by})' if by else ''} (rate({s(name, extra)}[{RATE}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le{', ' + by if by else ''}) (rate({s(histogram + '_bucket')}[{RATE}])))"


# (row title, [(panel title, unit, [(expr, legend)], description)])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], str]]]] = [
    ("Requests", [
        ("Requests running / waiting", "short", [
            (f"sum by (instance) ({s('kvserve:num_requests_running')})", "running {{instance}}"),
            (f"sum by (instance) ({s('kvserve:num_requests_waiting')})", "waiting {{instance}}"),
        ], "Running batch and the queue (queued, preempted, or loading KV from a tier)."),
        ("Token throughput", "short", [
            (rate("kvserve:prompt_tokens_total"), "prompt tokens/s"),
            (rate("kvserve:generation_tokens_total"), "generated tokens/s"),
        ], "Prompt tokens admitted and tokens generated per second."),
        ("Finished requests by reason", "reqps", [
            (rate("kvserve:request_success_total", by="finished_reason"), "{{finished_reason}}"),
        ], "stop / length are served; abort, rejected (shed for the TTFT target) and error are not."),
        ("Preemptions and swaps", "short", [
            (rate("kvserve:num_preemptions_total"), "preemptions/s"),
            (rate("kvserve:kv_host_swaps_total", by="event"), "swap {{event}}/s"),
        ], "Requests preempted for lack of KV blocks; with a host tier, swapped out / in / failed."),
    ]),
    ("KV cache by tier and tenant", [
        ("GPU KV cache usage", "percentunit", [
            (f"max by (instance) ({s('kvserve:kv_cache_usage_perc')})", "{{instance}}"),
        ], "Fraction of GPU KV blocks held by requests (cached blocks no request holds count as free)."),
        ("KV usage by tier", "percentunit", [
            (f"sum({s('kvserve:kv_cache_blocks_used')}) / sum({s('kvserve:kv_cache_blocks_total')})", "gpu"),
            (f"sum({s('kvserve:kv_host_blocks_used')}) / sum({s('kvserve:kv_host_blocks_total')})", "host"),
            (f"sum by (tier) ({s('kvserve:kv_tier_bytes_used')}) / "
             f"(sum by (tier) ({s('kvserve:kv_tier_capacity_bytes')}) > 0)", "{{tier}}"),
        ], "GPU and host tier blocks in use; disk / remote bytes over their cap (a remote tier bounded "
           "only by Redis maxmemory has no cap: see the next panel)."),
        ("Disk / remote tier bytes", "bytes", [
            (f"sum by (tier) ({s('kvserve:kv_tier_bytes_used')})", "{{tier}} used"),
            (f"sum by (tier) ({s('kvserve:kv_tier_capacity_bytes')})", "{{tier}} cap"),
        ], "Bytes the cold tiers' blocks take, as far as this process knows."),
        ("GPU KV blocks by tenant", "short", [
            (f"sum by (tenant) ({s('kvserve:tenant_kv_blocks')})", "{{tenant}}"),
            (f"sum by (tenant) ({s('kvserve:tenant_kv_resident_blocks')})", "{{tenant}} resident (quota'd)"),
        ], "Blocks held by each tenant's running requests; tenants with a KV quota also show running + cached."),
    ]),
    ("Hit rates", [
        ("Prefix-cache hit rate", "percentunit", [
            (f"{rate('kvserve:prefix_cache_hits_total')} / {rate('kvserve:prefix_cache_queries_total')}",
             "GPU prefix cache (tokens)"),
        ], "Prompt tokens served from the GPU prefix cache over prompt tokens looked up."),
        ("Prompt tokens served from KV, by tier", "short", [
            (rate("kvserve:prefix_cache_hits_total"), "gpu"),
            (rate("kvserve:kv_host_hit_tokens_total"), "host"),
            (rate("kvserve:kv_tier_hit_tokens_total", by="tier"), "{{tier}}"),
        ], "Tokens per second whose KV was reused instead of computed, by where it came from."),
        ("Disk / remote lookup hit ratio", "percentunit", [
            (f"{rate('kvserve:kv_tier_lookups_total', HIT, by='tier')} / "
             f"{rate('kvserve:kv_tier_lookups_total', by='tier')}", "{{tier}}"),
        ], "Blocks found over blocks looked up in each cold tier."),
    ]),
    ("Latency", [
        ("Time to first token", "s", [
            (quantile(0.5, "kvserve:time_to_first_token_seconds"), "p50"),
            (quantile(0.99, "kvserve:time_to_first_token_seconds"), "p99"),
        ], "Arrival to first token (served requests)."),
        ("Time per output token", "s", [
            (quantile(0.5, "kvserve:time_per_output_token_seconds"), "p50"),
            (quantile(0.99, "kvserve:time_per_output_token_seconds"), "p99"),
        ], "Per request, (last token - first token) / (tokens - 1)."),
        ("End-to-end and queue time p99", "s", [
            (quantile(0.99, "kvserve:e2e_request_latency_seconds"), "e2e p99"),
            (quantile(0.99, "kvserve:request_queue_time_seconds"), "queue p99"),
        ], "Arrival to last token, and arrival to first scheduling."),
        ("Latency targets: outcomes", "reqps", [
            (rate("kvserve:requests_slo_total", by="outcome"), "{{outcome}}"),
            (rate("kvserve:requests_shed_total", by="where"), "shed at {{where}}"),
        ], "With --slo-ttft / --slo-tpot: finished requests that met every target or missed one; shed (503)."),
        ("TTFT p99 by tenant", "s", [
            (quantile(0.99, "kvserve:tenant_time_to_first_token_seconds", by="tenant"), "{{tenant}}"),
        ], "Per tenant (API key), the 99th percentile time to first token."),
    ]),
    ("Memory bandwidth", [
        ("HBM bandwidth utilisation", "percentunit", [
            (f"max by (instance) ({s('kvserve:hbm_bandwidth_utilization')})", "latest {{instance}}"),
            (quantile(0.5, "kvserve:hbm_bandwidth_utilization_per_step"), "per step p50"),
            (quantile(0.99, "kvserve:hbm_bandwidth_utilization_per_step"), "per step p99"),
        ], "Bytes the steps read (weights + KV) over their time, as a fraction of the measured peak."),
        ("Bytes read per second vs peak", "Bps", [
            (rate("kvserve:step_bytes_read_total", by="instance"), "read {{instance}}"),
            (f"max by (instance) ({s('kvserve:memory_bandwidth_peak_bytes_per_second')})", "peak {{instance}}"),
        ], "Read rate of the engine steps against the copy bandwidth measured at start."),
        ("KV tier traffic", "Bps", [
            (rate("kvserve:kv_host_bytes_moved_total", by="direction"), "host {{direction}}"),
            (rate("kvserve:kv_tier_bytes_total", by="tier, direction"), "{{tier}} {{direction}}"),
        ], "Bytes copied between the GPU and the host tier, and read from / written to disk and remote."),
        ("Decode KV bytes per step", "bytes", [
            (f"{rate('kvserve:decode_kv_bytes_total')} / {rate('kvserve:engine_steps_total')}", "KV bytes / step"),
        ], "KV bytes decode attention read per engine step (shorter once pressed or tiered)."),
    ]),
    ("Evictions", [
        ("Prefix-cache evictions by policy", "short", [
            (rate("kvserve:prefix_cache_evictions_total", by="policy"), "{{policy}}"),
        ], "Cached GPU blocks evicted per second, by the policy that chose them (adaptive shows its arms)."),
        ("Eviction policy in force", "short", [
            (f"max by (policy, active) ({s('kvserve:prefix_cache_policy_info')})", "{{policy}} -> {{active}}"),
        ], "Configured policy and the one ranking blocks now (1 while in force)."),
        ("Tier evictions", "short", [
            (rate("kvserve:kv_host_blocks_evicted_total"), "host"),
            (rate("kvserve:kv_tier_evictions_total", by="tier"), "{{tier}}"),
        ], "Host blocks reused for newer ones; disk / remote blocks removed to stay under the cap."),
    ]),
    ("Tier health", [
        ("Tier available", "short", [
            (f"min by (tier) ({s('kvserve:kv_tier_available')})", "{{tier}}"),
        ], "1 while the tier answers and takes writes; 0: the remote server is down or the disk is full."),
        ("Tier errors, corrupt blocks, dropped writes", "short", [
            (rate("kvserve:kv_tier_errors_total", by="tier"), "{{tier}} errors"),
            (rate("kvserve:kv_tier_corrupt_total", by="tier"), "{{tier}} corrupt"),
            (rate("kvserve:kv_tier_writes_dropped_total", by="tier"), "{{tier}} writes dropped"),
            (rate("kvserve:kv_host_copy_failures_total"), "host copy failures"),
            (rate("kvserve:engine_step_errors_total"), "engine step errors"),
        ], "Per second: I/O errors, blocks failing their checks, writes not made."),
    ]),
    ("Configuration", [
        ("Configuration changes", "short", [
            (f"sum by (field, source) (increase({s('kvserve:config_changes_total')}[{RATE}]))",
             "{{field}} ({{source}})"),
        ], "Settings changed at run time (admin API, adaptive policy), by field and source."),
    ]),
]

VARIABLES = [
    {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "query": "prometheus",
     "current": {}, "hide": 0, "refresh": 1, "options": [], "regex": ""},
    {"name": "model_name", "label": "Model", "type": "query", "datasource": DATASOURCE,
     "query": {"query": "label_values(kvserve:num_requests_running, model_name)", "refId": "model_name"},
     "definition": "label_values(kvserve:num_requests_running, model_name)",
     "includeAll": True, "allValue": ".*", "multi": True, "current": {}, "hide": 0, "refresh": 2, "options": [],
     "regex": "", "sort": 1},
    {"name": "instance", "label": "Instance", "type": "query", "datasource": DATASOURCE,
     "query": {"query": 'label_values(kvserve:num_requests_running{model_name=~"$model_name"}, instance)',
               "refId": "instance"},
     "definition": 'label_values(kvserve:num_requests_running{model_name=~"$model_name"}, instance)',
     "includeAll": True, "allValue": ".*", "multi": True, "current": {}, "hide": 0, "refresh": 2, "options": [],
     "regex": "", "sort": 1},
]

# Marks on every time series where a setting changed at run time.
ANNOTATIONS = [
    {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
     "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
    {"datasource": DATASOURCE, "enable": True, "iconColor": "orange", "name": "Config changes",
     "expr": f"sum by (field, source) (changes({s('kvserve:config_changes_total')}[2m])) > 0",
     "titleFormat": "config change", "textFormat": "{{field}} by {{source}}", "step": "1m"},
]


def _panel(panel_id: int, title: str, unit: str, queries: list[tuple[str, str]], description: str,
           x: int, y: int) -> dict:
    return {
        "id": panel_id, "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "color": {"mode": "palette-classic"},
                                     "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                                "showPoints": "never", "spanNulls": False}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"datasource": DATASOURCE, "editorMode": "code", "expr": expr, "legendFormat": legend,
                     "range": True, "refId": chr(ord("A") + i)} for i, (expr, legend) in enumerate(queries)],
    }


def build() -> dict:
    panels, panel_id, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": panel_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for i, (title, unit, queries, description) in enumerate(row_panels):
            panels.append(_panel(panel_id, title, unit, queries, description, x=12 * (i % 2), y=y + 8 * (i // 2)))
            panel_id += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "title": "kvserve", "uid": "kvserve-overview", "description": "kvserve: requests, KV cache by tier and "
        "tenant, hit rates, latency, memory bandwidth, evictions (deploy/README.md)",
        "tags": ["kvserve", "llm"], "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "timezone": "", "fiscalYearStartMonth": 0,
        "liveNow": False, "links": [], "weekStart": "",
        "annotations": {"list": ANNOTATIONS},
        "templating": {"list": VARIABLES},
        "panels": panels,
    }


def write(path: Optional[str] = None) -> str:
    path = path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "kvserve-dashboard.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(build(), f, indent=2)
        f.write("\n")
    return path


if __name__ == "__main__":
    print(write())

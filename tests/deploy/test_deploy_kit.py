"""The deploy kit (deploy/): promtool accepts the alert rules and the example config, the rules'
unit tests (tests/deploy/alerts_test.yml) fire and stay quiet where they should, the Grafana
dashboard is valid JSON generated from deploy/grafana/make_dashboard.py with a query on every panel,
and every metric name the dashboard and the rules query is one /metrics exposes."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from kvserve.obs import metrics as obs_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvserve-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool")
requires_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed "
                                       "(bash scripts/install_system_packages.sh)")

_NAME = re.compile(r"(?<![A-Za-z0-9_:])((?:kvserve|vllm):[A-Za-z0-9_:]+)")


def listed_names() -> set[str]:
    """Every name of kvserve/obs/metrics.py's *_METRIC_NAMES lists (the names /metrics exposes)."""
    return {name for attr, value in vars(obs_metrics).items() if attr.endswith("METRIC_NAMES")
            for name in value}


def histogram_names() -> set[str]:
    """The histograms among them, from the `# TYPE` lines of a /metrics rendered with a host tier
    (its load-time histogram) and bandwidth stats (the per-step histogram) next to the request
    histograms, which are always there."""
    from kvserve.engine.async_engine import EngineSnapshot
    from kvserve.stats import (BandwidthStats, EngineStats, HostTierStats, KVCacheStats, SchedulerStats,
                               TransferStats)
    host = HostTierStats(num_blocks=64, used_blocks=10, hit_tokens=40, blocks_written=12, blocks_loaded=10,
                         blocks_evicted=2, writes_dropped=1, swapped_out=3, swapped_in=2, swap_failures=1)
    transfers = TransferStats(bytes_to_device=4096, bytes_to_host=8192, loads=3, load_seconds=0.03,
                              load_buckets=((0.001, 1), (0.01, 1), (0.1, 0)), write_back_blocks_dropped=2,
                              copy_failures=1)
    bandwidth = BandwidthStats(peak_bytes_per_s=1e10, peak_source="test", steps=3, bytes_read_total=3000,
                               weight_bytes_per_step=900, last_bytes_read=1000, last_step_s=0.001,
                               recent_utilization=0.1, utilization_buckets=((0.1, 3), (float("inf"), 0)))
    stats = EngineStats(SchedulerStats(2, 1, 3), KVCacheStats(100, 60, 0.4, 1600, host, transfers), 50, 20,
                        {"stop": 4}, bandwidth=bandwidth)
    snapshot = EngineSnapshot.from_stats(stats, num_steps=9, num_step_errors=0, rejected_by_gate=0)
    text = obs_metrics.ServerMetrics(lambda: snapshot, "m").render().decode()
    return {line.split()[2] for line in text.splitlines()
            if line.startswith("# TYPE ") and line.split()[3] == "histogram"}


def exposed_names() -> set[str]:
    """Names a PromQL query may use: the listed ones, and a histogram's
    _bucket / _sum / _count."""
    names = listed_names()
    histograms = histogram_names()
    assert histograms <= names, histograms - names
    return names | {h + suffix for h in histograms for suffix in ("_bucket", "_sum", "_count")}


def dashboard_exprs(dashboard: dict) -> list[str]:
    """Every PromQL string of the dashboard: panel targets, annotations, variable queries."""
    exprs = []

    def visit(panels):
        for panel in panels:
            exprs.extend(target["expr"] for target in panel.get("targets", []))
            visit(panel.get("panels", []))
    visit(dashboard["panels"])
    exprs.extend(a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a)
    exprs.extend(v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query")
    return exprs


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@requires_promtool
def test_promtool_accepts_the_rules_and_the_example_config():
    for args in (["check", "rules", str(ALERTS)], ["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")]):
        result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    assert "6 rules found" in subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True,
                                             text=True, timeout=60).stdout


@requires_promtool
def test_the_alerts_fire_after_their_for_and_only_then():
    """promtool's rule unit tests: KV full with a queue, hit rate collapse vs an hour ago, SLO misses,
    engine down (down, not kvserve, not discovered), tier unavailable, step errors."""
    result = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=pathlib.Path(__file__).parent,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", (pathlib.Path(__file__).parent / "alerts_test.yml").read_text()))
    alerts = {rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}
    assert alerts == tested == {"KVCacheFull", "PrefixHitRateCollapse", "SLOMisses", "EngineDown",
                                "TierUnavailable", "EngineStepErrors"}


def test_every_alert_has_a_summary_and_a_description():
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]


def test_the_dashboard_json_is_what_the_generator_writes(dashboard):
    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import make_dashboard
    finally:
        sys.path.pop(0)
    assert dashboard == make_dashboard.build(), "run `python deploy/grafana/make_dashboard.py`"


def test_the_dashboard_is_a_grafana_dashboard_with_a_query_on_every_panel(dashboard):
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query" and variables["instance"]["type"] == "query"
    ids, panels = set(), []

    def visit(items):
        for panel in items:
            assert panel["id"] not in ids, panel["id"]
            ids.add(panel["id"])
            panels.append(panel)
            visit(panel.get("panels", []))
    visit(dashboard["panels"])
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 25
    cells = set()
    for panel in graphs:
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], panel["title"]
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            # Each series follows the dashboard's model and instance choices.
            for selector in re.findall(r"kvserve:[A-Za-z0-9_:]+(\{[^}]*\})?", target["expr"]):
                assert 'model_name=~"$model_name"' in selector and 'instance=~"$instance"' in selector, \
                    (panel["title"], target["expr"])
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("kv cache by tier and tenant", "hit rate", "time to first token", "time per output token",
                  "bandwidth", "evictions by policy", "configuration changes", "tier available"):
        assert topic in titles, topic


def test_every_metric_the_kit_queries_is_one_metrics_exposes(dashboard):
    exposed = exposed_names()
    used = {name for expr in dashboard_exprs(dashboard) + rule_exprs() for name in _NAME.findall(expr)}
    assert used, "no metric names found"
    assert not {n for n in used if n.startswith("vllm:")}, "the kit queries kvserve's own names"
    assert used <= exposed, sorted(used - exposed)
    # And the kit covers what the issue asks to see.
    for name in ("kvserve:kv_cache_usage_perc", "kvserve:kv_host_blocks_used", "kvserve:kv_tier_bytes_used",
                 "kvserve:tenant_kv_blocks", "kvserve:prefix_cache_hits_total", "kvserve:kv_host_hit_tokens_total",
                 "kvserve:time_to_first_token_seconds_bucket", "kvserve:time_per_output_token_seconds_bucket",
                 "kvserve:hbm_bandwidth_utilization", "kvserve:prefix_cache_evictions_total",
                 "kvserve:num_preemptions_total", "kvserve:kv_tier_corrupt_total", "kvserve:kv_tier_errors_total",
                 "kvserve:config_changes_total", "kvserve:requests_slo_total", "kvserve:kv_tier_available"):
        assert name in used, name


def test_the_name_check_catches_a_misspelt_metric(dashboard):
    """The check above is not vacuous: a name /metrics does not expose is found."""
    exposed = exposed_names()
    broken = json.loads(json.dumps(dashboard).replace("kvserve:kv_cache_usage_perc", "kvserve:kv_cache_usage_pct"))
    used = {name for expr in dashboard_exprs(broken) for name in _NAME.findall(expr)}
    assert used - exposed == {"kvserve:kv_cache_usage_pct"}
    assert "kvserve:kv_cache_usage_perc_bucket" not in exposed     # a gauge has no buckets

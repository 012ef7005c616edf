"""A real Prometheus (Debian's `prometheus`; scripts/install_system_packages.sh installs it in CI)
scraping a running kvserve every second with deploy/prometheus/alerts.yml loaded: the values it
stores for `kvserve:kv_cache_usage_perc`, the token and request counters, a histogram and a vLLM
alias equal what /metrics shows; every alert rule is loaded and evaluates without error (and the
ones whose condition is false on this healthy server are inactive); every Grafana dashboard query
is valid PromQL and the core panels have data (benchmarks/obs/render_dashboard_panels.py); and when
the server stops, `up` turns 0 and EngineDown goes pending."""

from __future__ import annotations

import json
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import httpx
import pytest
import yaml

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.slow, requires_default_model,
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed "
                                 "(bash scripts/install_system_packages.sh)")]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class Prometheus:
    """`prometheus` on a free loopback port, in a temporary directory (config + TSDB), scraping
    `target` every second as job "kvserve" with the deploy kit's rules; stop() ends it (SIGTERM)."""

    def __init__(self, target: str) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvserve-prometheus-")
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                  "rule_files": [str(ROOT / "deploy" / "prometheus" / "alerts.yml")],
                  "scrape_configs": [{"job_name": "kvserve", "static_configs": [{"targets": [target]}]}]}
        config_path = pathlib.Path(self.directory) / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(pathlib.Path(self.directory) / "prometheus.log", "w")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config_path}",
                                      f"--storage.tsdb.path={self.directory}/data",
                                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        try:
            _wait(lambda: self._alive() and httpx.get(self.url + "/-/ready", timeout=2).status_code == 200,
                  60, "prometheus to be ready")
        except BaseException:
            self.stop()
            raise

    def _alive(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log_text()}"
        return True

    def log_text(self) -> str:
        self.log.flush()
        return (pathlib.Path(self.directory) / "prometheus.log").read_text()[-3000:]

    def api(self, path: str, **params) -> Any:
        answer = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10).json()
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> dict[str, float]:
        """Instant query: {instance label set as text: value}."""
        return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
                for r in self.api("query", query=expr)["result"]}

    def stop(self) -> int:
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    return self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
                    raise AssertionError("prometheus did not stop on SIGTERM")
            return self.proc.returncode
        finally:
            self.log.close()
            shutil.rmtree(self.directory, ignore_errors=True)


def _scraped(text: str, name: str, labels: str = '{model_name="tiny"}') -> float:
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name + labels)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-prometheus"), max_position_embeddings=512)


def test_prometheus_scrapes_kvserve_and_evaluates_the_deploy_rules(tiny_model, tmp_path):
    from kvserve.engine.engine import Engine
    if str(ROOT) not in sys.path:        # benchmarks/ is a package at the repository root
        sys.path.insert(0, str(ROOT))
    from benchmarks.obs.render_dashboard_panels import check

    # Latency targets (generous: every request meets them) light up requests_slo_total for SLOMisses;
    # a host and a disk tier the dashboard's tier panels.
    engine = Engine.from_options(model=tiny_model, max_model_len=256, kv_cache_memory=4 << 20, slo_ttft=60.0,
                                 kv_host_memory=4 << 20, kv_disk_path=str(tmp_path / "kv-disk"), kv_disk_size=16 << 20)
    server = LoopbackServer(engine, vllm_metric_aliases=True)
    prometheus = None
    try:
        prometheus = Prometheus(server.url.removeprefix("http://"))
        _wait(lambda: prometheus.query('up{job="kvserve"} == 1'), 30, "the first successful scrape")
        prompt = "A shared system prompt about the weather in many cities of the world. " * 3
        for i in range(3):     # the same prompt: the second and third hit the prefix cache
            response = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": prompt + f"Question {i}?", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
        _wait(lambda: server.snapshot.num_running == 0 and server.snapshot.num_waiting == 0, 30, "an idle engine")
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert _scraped(text, "kvserve:generation_tokens_total") == 12

        # Prometheus stores what /metrics shows (the engine is idle, so nothing moves meanwhile).
        checks = {"kvserve:kv_cache_usage_perc": "kvserve:kv_cache_usage_perc",
                  "kvserve:generation_tokens_total": "kvserve:generation_tokens_total",
                  "kvserve:prompt_tokens_total": "kvserve:prompt_tokens_total",
                  "kvserve:prefix_cache_hits_total": "kvserve:prefix_cache_hits_total",
                  "kvserve:time_to_first_token_seconds_count": "kvserve:time_to_first_token_seconds_count",
                  "vllm:kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
                  "vllm:generation_tokens_total": "vllm:generation_tokens_total"}
        expected = {name: _scraped(text, source) for name, source in checks.items()}
        assert expected["kvserve:prefix_cache_hits_total"] > 0
        assert expected["kvserve:time_to_first_token_seconds_count"] == 3

        def stored() -> dict[str, float]:
            values = {}
            for name in checks:
                result = prometheus.query(f'{name}{{job="kvserve",model_name="tiny"}}')
                if len(result) != 1:
                    return {}
                values[name] = next(iter(result.values()))
            return values if values == expected else {}
        _wait(stored, 30, f"Prometheus to store {expected}")
        finished = prometheus.query('kvserve:request_success_total{finished_reason="length"}')
        assert list(finished.values()) == [3.0]
        series = prometheus.api("series", **{"match[]": "kvserve:kv_cache_usage_perc"})
        assert series[0]["instance"] == server.url.removeprefix("http://") and series[0]["job"] == "kvserve"

        # Every rule of alerts.yml is loaded and evaluates cleanly against the live series.
        alerts = {rule["alert"] for group in yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
                  ["groups"] for rule in group["rules"]}

        def evaluated() -> dict[str, dict]:
            rules = {rule["name"]: rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]}
            return rules if set(rules) == alerts and all(r["health"] == "ok" for r in rules.values()) else {}
        rules = _wait(evaluated, 30, "the alert rules to evaluate")
        assert all(rule["type"] == "alerting" for rule in rules.values())
        for name in ("EngineDown", "KVCacheFull", "SLOMisses", "TierUnavailable", "EngineStepErrors"):
            assert rules[name]["state"] == "inactive", (name, rules[name])

        # Every dashboard query is PromQL Prometheus accepts; the panels of what this server runs draw.
        dashboard = json.loads((ROOT / "deploy/grafana/kvserve-dashboard.json").read_text())
        rows = check(prometheus.url, dashboard, range_s=60, step_s=1, rate_interval="30s")
        assert not [row for row in rows if row["status"] == "error"], [r for r in rows if r["status"] == "error"]
        with_data = {row["panel"] for row in rows if row["status"] == "data"}
        print("dashboard panels with data:", sorted(with_data))
        for panel in ("Requests running / waiting", "Token throughput", "Finished requests by reason",
                      "GPU KV cache usage", "KV usage by tier", "Prefix-cache hit rate",
                      "Prompt tokens served from KV, by tier", "Time to first token", "Time per output token",
                      "End-to-end and queue time p99", "Latency targets: outcomes", "Decode KV bytes per step",
                      "Prefix-cache evictions by policy", "Eviction policy in force", "Disk / remote tier bytes",
                      "Tier available", "Tier evictions", "HBM bandwidth utilisation"):
            assert panel in with_data, (panel, [r for r in rows if r["panel"] == panel])
        hit_rate = next(r for r in rows if r["panel"] == "Prefix-cache hit rate")
        assert 0 < hit_rate["last"] <= 1
        by_tier = {r["legend"]: r for r in rows if r["panel"] == "KV usage by tier"}
        assert by_tier["gpu"]["status"] == by_tier["host"]["status"] == by_tier["{{tier}}"]["status"] == "data"

        # The server goes away: the next scrapes fail and EngineDown is pending (for: 1m).
        server.stop()
        server = None
        _wait(lambda: prometheus.query('up{job="kvserve"} == 0'), 30, "up to turn 0")

        def engine_down_pending() -> bool:
            rules = {r["name"]: r for g in prometheus.api("rules")["groups"] for r in g["rules"]}
            return rules["EngineDown"]["state"] == "pending"
        _wait(engine_down_pending, 30, "EngineDown to go pending")
    finally:
        if server is not None:
            server.stop()
        if prometheus is not None:
            log = prometheus.log_text()
            assert prometheus.stop() == 0, log

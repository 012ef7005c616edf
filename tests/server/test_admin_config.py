"""/v1/admin/config over HTTP: only the admin key opens it (401 without a key or with a wrong one,
403 with a tenant's key or on a server without an admin key); a refused value or an unknown field is
a 400 naming the field and changes nothing; a change is in the next GET, in /metrics (the setting's
gauge, the change counter, the policy in force) and in what /metrics judges requests by. Through an
in-process engine, the engine core process, and once the real `kvserve serve` with two front ends."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, ServeProcess, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]

KEYS = {"sk-alice": "alice"}
ADMIN = "sk-operator"
URL = "/v1/admin/config"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-admin-config"), max_position_embeddings=2048)


@pytest.fixture(scope="module", params=["core-process", "in-process"])
def server(request, folder, tmp_path_factory):
    files = tmp_path_factory.mktemp("admin-config")
    (files / "keys.json").write_text(json.dumps(KEYS))
    # The host tier off on every device (on CUDA it is on by default): a refused resize is tested below.
    options = dict(model=folder, max_model_len=1024, kv_cache_memory=8 << 20, kv_host_memory=0)
    server_options = dict(api_keys_file=str(files / "keys.json"), admin_api_key=ADMIN)
    if request.param == "core-process":
        server = LoopbackServer(engine_options=options, **server_options)
    else:
        from kvserve.engine.engine import Engine
        server = LoopbackServer(Engine.from_options(**options), **server_options)
    yield server.url
    server.stop()


def _admin(key: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _get(url: str) -> dict:
    response = httpx.get(url + URL, headers=_admin(), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _patch(url: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.patch(url + URL, json=body, headers=_admin(key), timeout=60)


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of `name` with these labels (0 when there is none)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_only_the_admin_key_opens_the_config(server):
    for method in ("GET", "PATCH"):
        body = {"json": {"lru_k": 3}} if method == "PATCH" else {}
        missing = httpx.request(method, server + URL, timeout=30, **body)
        assert missing.status_code == 401 and "admin" in missing.json()["error"]["message"]
        assert httpx.request(method, server + URL, headers=_admin("sk-wrong"), timeout=30, **body).status_code == 401
        tenant = httpx.request(method, server + URL, headers=_admin("sk-alice"), timeout=30, **body)
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_key_required"
    assert _get(server)["config"]["lru_k"] == 2           # none of those changed anything


@pytest.mark.parametrize("method", ["PATCH", "POST"])
def test_a_body_not_labelled_json_is_refused_before_it_is_read(server, method):
    """Only a JSON body, as on every POST route (a browser sends text/plain to any origin without a
    preflight); nothing changes."""
    before = httpx.get(server + "/v1/admin/config", headers=_admin(), timeout=30).json()["config"]
    response = httpx.request(method, server + "/v1/admin/config", content=b'{"max_num_batched_tokens": 64}',
                             headers={**_admin(), "Content-Type": "text/plain"}, timeout=30)
    assert response.status_code == 415, response.text
    assert httpx.get(server + "/v1/admin/config", headers=_admin(), timeout=30).json()["config"] == before


def test_a_server_without_an_admin_key_refuses_it(folder):
    from kvserve.engine.engine import Engine
    server = LoopbackServer(Engine.from_options(model=folder, max_model_len=256, kv_cache_memory=4 << 20))
    try:
        response = httpx.get(server.url + URL, headers=_admin(), timeout=30)
        assert response.status_code == 403 and response.json()["error"]["code"] == "admin_key_not_set"
    finally:
        server.stop()


@pytest.mark.parametrize("body,param,message", [
    ({"lru_k": 9}, "lru_k", "lru_k must be in [1, 8], got 9"),
    ({"eviction_policy": "mru"}, "eviction_policy", "eviction_policy must be one of"),
    ({"kv_press": "bogus", "kv_keep_ratio": 0.5}, "kv_press", "--kv-press 'bogus' is not a press"),
    ({"kv_host_memory": "1GiB"}, "kv_host_memory", "the host KV tier is off"),
    ({"qos_classes": {"gold": {"ttft_p99": 1.0}}}, "qos_classes.gold", "no such request class"),
    ({"slo_ttft": -2}, "slo_ttft", "slo_ttft must be > 0 seconds"),
    ({"lru_k": "3"}, "lru_k", "lru_k"),                                   # the schema: an integer
    ({"colour": "blue"}, "colour", "colour: Extra inputs are not permitted"),
    ({"block_size": 8}, "block_size", "block_size: Extra inputs are not permitted"),
    ({"lru_k": 3, "max_num_batched_tokens": 0}, "max_num_batched_tokens", "max_num_batched_tokens must be >= 1"),
])
def test_a_refused_change_is_a_400_naming_the_field_and_changes_nothing(server, body, param, message):
    before = _get(server)["config"]
    response = _patch(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert _get(server)["config"] == before


def test_a_change_reaches_get_and_metrics(server):
    metrics = httpx.get(server + "/metrics", timeout=30).text
    changes_before = _metric(metrics, "kvserve:config_changes_total", field="max_num_batched_tokens", source="admin")
    budget = int(_get(server)["config"]["max_num_batched_tokens"])
    response = _patch(server, {"eviction_policy": "lru-k", "lru_k": 3, "max_num_batched_tokens": budget // 2})
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["changed"]["max_num_batched_tokens"] == {"old": budget, "new": budget // 2}
    assert reply["changed"]["eviction_policy"]["new"] == "lru-k"
    config = _get(server)
    assert (config["config"]["eviction_policy"], config["config"]["lru_k"]) == ("lru-k", 3)
    assert [e["field"] for e in config["events"][-3:]] == ["eviction_policy", "lru_k", "max_num_batched_tokens"]
    assert all(e["source"] == "admin" for e in config["events"][-3:])
    metrics = httpx.get(server + "/metrics", timeout=30).text
    assert _metric(metrics, "kvserve:config_value", field="max_num_batched_tokens") == budget // 2
    assert _metric(metrics, "kvserve:config_value", field="lru_k") == 3
    assert _metric(metrics, "kvserve:config_changes_total", field="max_num_batched_tokens",
                   source="admin") == changes_before + 1
    assert _metric(metrics, "kvserve:config_info", field="eviction_policy", value="lru-k") == 1
    assert _metric(metrics, "kvserve:prefix_cache_policy_info", policy="lru-k", active="lru-k(k=3,h=120s)") == 1
    # Back as it was (POST takes the same body), for the other tests.
    restore = httpx.post(server + URL, json={"eviction_policy": "lru", "lru_k": 2, "max_num_batched_tokens": budget},
                         headers=_admin(), timeout=30)
    assert restore.status_code == 200 and restore.json()["config"]["eviction_policy"] == "lru"


def test_a_latency_target_set_at_run_time_is_what_metrics_judge_by(server):
    metrics = httpx.get(server + "/metrics", timeout=30).text
    assert "kvserve:requests_slo_total" not in metrics                   # no targets at start
    response = _patch(server, {"slo_ttft": 600.0})
    assert response.status_code == 200, response.text
    assert httpx.get(server + "/metrics", timeout=30).text.count("kvserve:slo_max_running_requests{") == 1
    completion = httpx.post(server + "/v1/completions", headers=_admin("sk-alice"), timeout=60,
                            json={"prompt": "Hello there", "max_tokens": 3, "ignore_eos": True})
    assert completion.status_code == 200, completion.text
    metrics = httpx.get(server + "/metrics", timeout=30).text
    assert _metric(metrics, "kvserve:requests_slo_total", outcome="met") == 1
    assert _metric(metrics, "kvserve:config_value", field="slo_ttft") == 600.0
    assert _patch(server, {"slo_ttft": None}).json()["config"]["slo_ttft"] is None
    metrics = httpx.get(server + "/metrics", timeout=30).text
    assert "kvserve:slo_max_running_requests{" not in metrics, [l for l in metrics.splitlines() if "slo" in l]
    assert _metric(metrics, "kvserve:config_value", field="slo_ttft") == 0


def test_the_real_server_with_two_front_ends_shows_a_change_on_both(folder, tmp_path):
    server = ServeProcess(["--model", folder, "--max-model-len", "512", "--kv-cache-memory", "16MiB",
                           "--admin-api-key", ADMIN, "--api-server-count", "2", "--max-num-batched-tokens", "512",
                           "--shutdown-timeout", "10"], tmp_path / "serve.log", log_level="info")
    try:
        response = _patch(server.url, {"max_num_batched_tokens": 256, "heat_half_life_s": 60})
        assert response.status_code == 200, response.text
        assert response.json()["changed"] == {"heat_half_life_s": {"old": 120.0, "new": 60.0},
                                              "max_num_batched_tokens": {"old": 512, "new": 256}}
        refused = _patch(server.url, {"kv_keep_ratio": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_keep_ratio"
        # Each request on a connection of its own: the kernel spreads them over both front ends,
        # and each has the engine core's snapshot.
        for _ in range(6):
            assert _get(server.url)["config"]["max_num_batched_tokens"] == 256
            metrics = httpx.get(server.url + "/metrics", timeout=30).text
            assert _metric(metrics, "kvserve:config_value", field="max_num_batched_tokens") == 256
            assert _metric(metrics, "kvserve:config_changes_total", field="heat_half_life_s", source="admin") == 1
        completion = httpx.post(server.url + "/v1/completions", timeout=60,
                                json={"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True})
        assert completion.status_code == 200, completion.text
    finally:
        code = server.stop()
    assert code == 0
    log = server.log()
    assert "config change (admin): max_num_batched_tokens 512 -> 256" in log

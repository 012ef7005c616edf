"""Prefix caching through the HTTP server: tenant isolation by API key, cache_salt, the pin API,
request-level pins, and the /metrics series. A tiny random Llama with the default model's real
tokenizer and chat template keeps it fast (greedy outputs are still compared hit vs. cold)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}
SYSTEM = ("You are the support assistant of a company that sells storage appliances. Answer briefly, "
          "cite the manual section when you can, and never promise delivery dates. ") * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-prefix"), max_position_embeddings=2048)
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    # Through the engine core process, as `kvserve serve` runs it: pins and tenants cross it.
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=1024, kv_cache_memory=8 << 20,
                                                eviction_policy="adaptive"), api_keys_file=str(keys))
    yield server.url, server
    server.stop()


def _metric(url: str, name: str, **labels: str) -> float:
    total, found = 0.0, False
    for line in httpx.get(url + "/metrics").text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total, found = total + float(match.group(2)), True
    assert found, name
    return total


def _chat(url: str, key: str, question: str, **extra) -> tuple[str, float]:
    """(answer, prefix-cache hit tokens this request added)."""
    before = _metric(url, "kvserve:prefix_cache_hits_total")
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"], _metric(url, "kvserve:prefix_cache_hits_total") - before


def test_a_tenant_never_hits_another_tenants_prefix(server):
    url, _ = server
    answer_a, hits = _chat(url, "sk-a", "Where is the reset button?")
    assert hits == 0
    claim = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-b"}, timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tenant": "tenant-a"})
    assert claim.status_code == 403 and claim.json()["error"]["param"] == "tenant"   # tenants come from keys
    answer_b, hits = _chat(url, "sk-b", "Where is the reset button?")
    assert hits == 0 and answer_b == answer_a
    _, hits = _chat(url, "sk-b", "Where is the reset button?", tenant="tenant-b")        # its own: fine
    assert hits > 0
    answer_a2, hits = _chat(url, "sk-a", "Where is the reset button?")
    assert hits > 0 and answer_a2 == answer_a
    _, hits = _chat(url, "sk-a", "How do I update the firmware?")          # shares the system prompt
    assert hits > 0
    _, hits = _chat(url, "sk-a", "Where is the reset button?", cache_salt="user-42")
    assert hits == 0
    _, hits = _chat(url, "sk-a", "Where is the reset button?", cache_salt="user-42")
    assert hits > 0
    assert _metric(url, "kvserve:kv_cache_blocks_used") == 0


def test_pin_api_is_per_tenant(server):
    url, _ = server
    auth_a, auth_b = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
    _chat(url, "sk-a", "Where is the reset button?")       # tenant-a computes the system prompt (again)
    body = {"messages": [{"role": "system", "content": SYSTEM}], "ttl": 120}
    response = httpx.post(url + "/v1/prefix/pin", json=body, headers=auth_a)
    assert response.status_code == 200, response.text
    pin = response.json()
    assert pin["object"] == "prefix_pin" and pin["num_blocks"] >= 2 and 0 < pin["expires_in"] <= 120
    assert pin["num_cached_blocks"] == pin["num_blocks"]          # tenant-a computed this system prompt
    assert [p["id"] for p in httpx.get(url + "/v1/prefix/pins", headers=auth_a).json()["data"]] == [pin["id"]]
    assert httpx.get(url + "/v1/prefix/pins", headers=auth_b).json()["data"] == []
    assert _metric(url, "kvserve:prefix_cache_pinned_blocks") == pin["num_blocks"]
    assert httpx.post(url + "/v1/prefix/unpin", json={"id": pin["id"]}, headers=auth_b).status_code == 404
    assert httpx.post(url + "/v1/prefix/unpin", json={"id": pin["id"]}, headers=auth_a).json()["deleted"] is True
    assert _metric(url, "kvserve:prefix_cache_pinned_blocks") == 0
    for bad in ({"prompt": "hi", "ttl": 10},                        # shorter than one block
                {"prompt": SYSTEM, "ttl": 0},
                {"prompt": SYSTEM, "messages": [{"role": "user", "content": "x"}]},
                {"prompt": [10 ** 9], "ttl": 5}):
        response = httpx.post(url + "/v1/prefix/pin", json=bad, headers=auth_a)
        assert response.status_code == 400, (bad, response.text)
        assert "error" in response.json()
    # A request can pin its own prompt.
    response = httpx.post(url + "/v1/completions", headers=auth_b, timeout=60, json={
        "prompt": SYSTEM, "max_tokens": 2, "temperature": 0, "pin_ttl": 30})
    assert response.status_code == 200, response.text
    [pinned] = httpx.get(url + "/v1/prefix/pins", headers=auth_b).json()["data"]
    assert pinned["num_cached_blocks"] == pinned["num_blocks"] > 0
    response = httpx.post(url + "/v1/completions", headers=auth_b, json={"prompt": "x", "pin_ttl": -1})
    assert response.status_code == 400


def test_prefix_cache_metrics(server):
    url, _ = server
    from kvserve.obs.metrics import METRIC_NAMES
    for _ in range(2):                                   # a miss then a hit, whichever tests ran before
        _chat(url, "sk-a", "Which section covers the fans?")
    text = httpx.get(url + "/metrics").text
    for name in METRIC_NAMES:
        assert name in text, name
    queries = _metric(url, "kvserve:prefix_cache_queries_total")
    hits = _metric(url, "kvserve:prefix_cache_hits_total")
    assert queries > hits > 0
    assert _metric(url, "kvserve:prefix_cache_hit_rate") == pytest.approx(hits / queries, rel=1e-6)
    assert _metric(url, "kvserve:prefix_cache_blocks") > 0
    assert _metric(url, "kvserve:prefix_cache_policy_info", policy="adaptive") == 1
    assert "kvserve:prefix_cache_adaptive_shadow_hit_rate" in text and 'arm="lru"' in text
    assert "kvserve:prefix_cache_evictions_total" in text


def _tenant_metric(url: str, name: str, tenant: str, **labels: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and f'tenant="{tenant}"' in match.group(1) and all(
                f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    return 0.0


def test_per_tenant_request_token_and_latency_series(server):
    url, _ = server
    names = ("kvserve:tenant_prompt_tokens_total", "kvserve:tenant_generation_tokens_total",
             "kvserve:tenant_time_to_first_token_seconds_count")
    before = {(n, t): _tenant_metric(url, n, t) for n in names for t in ("tenant-a", "tenant-b")}
    done = {t: _tenant_metric(url, "kvserve:tenant_requests_total", t, finished_reason="length")
            for t in ("tenant-a", "tenant-b")}
    _chat(url, "sk-a", "How do I update the firmware?")
    _chat(url, "sk-a", "What does the amber light mean?")
    _chat(url, "sk-b", "Can I add a shelf later?")
    assert _tenant_metric(url, "kvserve:tenant_requests_total", "tenant-a", finished_reason="length") == \
        done["tenant-a"] + 2
    assert _tenant_metric(url, "kvserve:tenant_requests_total", "tenant-b", finished_reason="length") == \
        done["tenant-b"] + 1
    assert _tenant_metric(url, names[1], "tenant-a") - before[(names[1], "tenant-a")] == 16     # 2 x max_tokens 8
    assert _tenant_metric(url, names[1], "tenant-b") - before[(names[1], "tenant-b")] == 8
    assert _tenant_metric(url, names[0], "tenant-a") - before[(names[0], "tenant-a")] > \
        _tenant_metric(url, names[0], "tenant-b") - before[(names[0], "tenant-b")] > 0
    assert _tenant_metric(url, names[2], "tenant-a") - before[(names[2], "tenant-a")] == 2

"""GET /v1/usage, the operator's summary per tenant: only the admin key opens it (401 without a key
or with a wrong one, 403 with a tenant's key or on a server without an admin key), and its figures
are the engine's: requests by finish reason, prompt, cached and generated tokens equal to what the
responses reported, the KV blocks a running request holds, and the fair policy's counters. Through
the engine core process and through an in-process engine; /metrics shows the same totals."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]

KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-anon": None}
ADMIN = "sk-operator"
WEIGHTS = {"alice": 3.0, "bob": 1.0}
PROMPT = "A long shared system prompt about the weather in many cities of the world. " * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-usage-summary"), max_position_embeddings=2048)


@pytest.fixture(scope="module", params=["core-process", "in-process"])
def server(request, folder, tmp_path_factory):
    files = tmp_path_factory.mktemp("usage-config")
    (files / "keys.json").write_text(json.dumps(KEYS))
    (files / "qos.json").write_text(json.dumps({"tenants": {t: {"weight": w} for t, w in WEIGHTS.items()}}))
    options = dict(model=folder, max_model_len=1024, kv_cache_memory=8 << 20, scheduling_policy="fair",
                   qos_config=str(files / "qos.json"))
    server_options = dict(api_keys_file=str(files / "keys.json"), admin_api_key=ADMIN)
    if request.param == "core-process":
        server = LoopbackServer(engine_options=options, **server_options)
    else:
        from kvserve.engine.engine import Engine
        server = LoopbackServer(Engine.from_options(**options), **server_options)
    yield server.url
    server.stop()


def _get_usage(url: str, key: str = ADMIN) -> httpx.Response:
    return httpx.get(url + "/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _rows(url: str) -> dict:
    response = _get_usage(url)
    assert response.status_code == 200, response.text
    return {row["tenant"]: row for row in response.json()["data"]}


def _complete(url: str, key: str, max_tokens: int = 4) -> dict:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def _until(check, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_only_the_admin_key_opens_the_usage_summary(server):
    missing = httpx.get(server + "/v1/usage")
    assert missing.status_code == 401 and "admin" in missing.json()["error"]["message"]
    assert _get_usage(server, "sk-wrong").status_code == 401
    tenant = _get_usage(server, "sk-alice")
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_key_required"
    assert "--admin-api-key" in tenant.json()["error"]["message"]
    # The admin key is the operator's, not a tenant's: it opens nothing else.
    completion = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                            headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert completion.status_code == 401
    assert _get_usage(server).status_code == 200


def test_the_summary_counts_what_the_responses_reported(server):
    before = _rows(server)
    alice = [_complete(server, "sk-alice") for _ in range(2)]     # the second one hits the prefix cache
    bob = [_complete(server, "sk-bob", max_tokens=3)]
    anonymous = [_complete(server, "sk-anon", max_tokens=2)]
    rows = _rows(server)
    for tenant, responses in (("alice", alice), ("bob", bob), (None, anonymous)):
        row, old = rows[tenant], before.get(tenant, {})

        def added(field: str) -> int:
            return row[field] - old.get(field, 0)
        assert row["requests"].get("length", 0) - old.get("requests", {}).get("length", 0) == len(responses)
        assert added("prompt_tokens") == sum(r["prompt_tokens"] for r in responses)
        assert added("cached_prompt_tokens") == sum(r["prompt_tokens_details"]["cached_tokens"] for r in responses)
        assert added("generation_tokens") == sum(r["completion_tokens"] for r in responses)
        assert row["kv_blocks"] == 0                                   # nothing of theirs runs now
    assert alice[1]["prompt_tokens_details"]["cached_tokens"] > 0
    # VTC: served = uncached prompt tokens + 2 x generated tokens; the counter is that over the
    # weight (the requests ran one at a time, so no counter was lifted).
    for tenant, weight in (("alice", 3.0), ("bob", 1.0), (None, 1.0)):
        row = rows[tenant]
        share = row["fair_share"]
        assert share["weight"] == weight
        assert share["served_weighted_tokens"] == pytest.approx(
            row["prompt_tokens"] - row["cached_prompt_tokens"] + 2 * row["generation_tokens"])
        assert share["virtual_token_counter"] == pytest.approx(share["served_weighted_tokens"] / weight)
    # /metrics reads the same totals.
    metrics = httpx.get(server + "/metrics").text
    for name, field in (("tenant_prompt_tokens_total", "prompt_tokens"),
                        ("tenant_cached_prompt_tokens_total", "cached_prompt_tokens"),
                        ("tenant_generation_tokens_total", "generation_tokens")):
        match = re.search(rf'^kvserve:{name}{{model_name="tiny",tenant="alice"}} (\S+)$', metrics, re.MULTILINE)
        assert match and float(match.group(1)) == rows["alice"][field], name


def test_a_running_request_holds_kv_blocks_and_an_abort_is_counted(server):
    prompt_blocks = _complete(server, "sk-anon", max_tokens=1)["prompt_tokens"] // 16
    aborted_before = _rows(server).get("bob", {}).get("requests", {}).get("abort", 0)
    body = {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-bob"},
                      timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        blocks = _until(lambda: _rows(server)["bob"]["kv_blocks"], "bob's running request holds no KV blocks")
        assert blocks >= prompt_blocks > 0                             # its prompt's blocks at least
    # The client went away: the engine aborts the request, frees its blocks and counts it.
    _until(lambda: _rows(server)["bob"]["requests"].get("abort", 0) == aborted_before + 1, "the abort was not counted")
    assert _rows(server)["bob"]["kv_blocks"] == 0


def test_a_server_without_an_admin_key_refuses_the_summary(folder):
    from kvserve.engine.engine import Engine
    server = LoopbackServer(Engine.from_options(model=folder, max_model_len=256, kv_cache_memory=4 << 20))
    try:
        refused = httpx.get(server.url + "/v1/usage", headers={"Authorization": "Bearer anything"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_not_set"
        assert "--admin-api-key" in refused.json()["error"]["message"]
    finally:
        server.stop()


def test_an_admin_key_that_is_also_an_api_key_is_refused_at_start(tmp_path):
    from kvserve.server.config import ServerConfig
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-x": "x"}))
    for config in (ServerConfig(api_keys_file=str(keys), admin_api_key="sk-x"),
                   ServerConfig(api_key="sk-y", admin_api_key="sk-y")):
        with pytest.raises(ValueError, match="admin_api_key must differ"):
            config.load_admin_key(config.load_api_keys())
    assert ServerConfig(api_keys_file=str(keys), admin_api_key="sk-admin").load_admin_key({"sk-x": "x"}) == "sk-admin"

"""KV presses through the HTTP server (engine core process, as `kvserve serve` runs): the request
fields reach the engine and free KV (counted in /metrics), the server's --kv-press default applies
and `kv_press: none` turns it off, the tier mode demotes and recalls (counted in /metrics), and bad
press fields are a 400 naming the field."""

from __future__ import annotations

import re

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]

PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the fence. " * 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-press"), max_position_embeddings=2048)
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=1024, kv_cache_memory=8 << 20,
                                                kv_press="streaming_llm", kv_keep_ratio=0.5, kv_press_min_tokens=64,
                                                enable_prefix_caching=False))
    yield server.url
    server.stop()


def _metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _complete(url: str, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra},
                      timeout=60)


def test_request_fields_and_server_default_prune_the_kv(server):
    response = _complete(server, kv_press="knorm", kv_keep_ratio=0.25)
    assert response.status_code == 200, response.text
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    assert _metric(server, "kvserve:kv_press_requests_total", press="knorm", outcome="applied") == 1
    assert _metric(server, "kvserve:kv_press_tokens_pruned_total", press="knorm") == prompt_tokens - round(
        0.25 * prompt_tokens)
    assert _metric(server, "kvserve:kv_press_blocks_freed_total", press="knorm") > 0
    assert _complete(server).status_code == 200                    # the server's default press
    assert _metric(server, "kvserve:kv_press_requests_total", press="streaming_llm", outcome="applied") == 1
    assert _complete(server, kv_press="none").status_code == 200     # turned off: nothing more pruned
    assert _metric(server, "kvserve:kv_press_requests_total", press="streaming_llm") == 1


@pytest.mark.parametrize("body, field", [
    ({"kv_press": "nonesuch"}, "kv_press"),
    ({"kv_press": "snapkv", "kv_keep_ratio": 0}, "kv_keep_ratio"),
    ({"kv_press": "snapkv", "kv_keep_ratio": 1.5}, "kv_keep_ratio"),
    ({"kv_press": "snapkv", "kv_keep_tokens": 0}, "kv_keep_tokens"),
    ({"kv_press": "snapkv", "kv_keep_ratio": 0.5, "kv_keep_tokens": 64}, "kv_keep_tokens"),
    ({"kv_press": "snapkv", "kv_keep_ratio": 0.5, "kv_press_mode": "sideways"}, "kv_press_mode"),
    # This server has no host tier (prefix caching is off), which the tier mode demotes to.
    ({"kv_press": "snapkv", "kv_keep_ratio": 0.5, "kv_press_mode": "tier"}, "kv_press_mode"),
])
def test_bad_press_fields_are_a_400_naming_the_field(server, body, field):
    response = _complete(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert _complete(server).status_code == 200                    # the engine is fine afterwards


def test_the_tier_mode_demotes_and_recalls_through_the_server(tmp_path):
    folder = build_tiny_chat_model(tmp_path / "tiny-tier", max_position_embeddings=2048)
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=1024, kv_cache_memory=8 << 20,
                                                kv_host_memory=8 << 20, kv_press_min_tokens=64,
                                                kv_tier_interval=1))
    try:
        response = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "kv_press": "snapkv",
            "kv_keep_ratio": 0.25, "kv_press_mode": "tier"})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 24
        assert _metric(server.url, "kvserve:kv_press_requests_total", press="snapkv", outcome="applied") == 1
        assert _metric(server.url, "kvserve:kv_press_tokens_demoted_total", press="snapkv") > 0
        assert _metric(server.url, "kvserve:kv_press_tokens_pruned_total", press="snapkv") == 0
    finally:
        server.stop()

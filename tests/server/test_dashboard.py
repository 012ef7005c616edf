"""GET /dashboard and its stream GET /dashboard/events (server/dashboard.py): the page is public
static HTML under a strict content policy, the stream opens only to the admin key (401 without or
with a wrong key, 403 with a tenant's key or without an admin key configured), its query bounds
hold, and its events carry the engine's real KV map and gauges, which follow requests as they run
and finish. Through the engine core process and through an in-process engine; and a real
`kvserve serve` stops soon after SIGTERM with a dashboard stream open."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import requires_default_model
from kvserve.server.dashboard import STREAM_LIFETIME_S
from loopback_server import LoopbackServer, ServeProcess, build_tiny_chat_model

pytestmark = [requires_default_model]

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
ADMIN = "sk-operator"
PROMPT = "The quick brown fox jumps over the lazy dog near the river bank, again and again. " * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-dashboard"), max_position_embeddings=4096)


@pytest.fixture(scope="module", params=["core-process", "in-process"])
def server(request, folder, tmp_path_factory):
    files = tmp_path_factory.mktemp("dashboard-keys")
    (files / "keys.json").write_text(json.dumps(KEYS))
    options = dict(model=folder, max_model_len=4096, kv_cache_memory=4 << 20, block_size=16,
                   kv_host_memory=0)   # one tier on every device (on CUDA the host tier is on by default)
    server_options = dict(api_keys_file=str(files / "keys.json"), admin_api_key=ADMIN)
    if request.param == "core-process":
        server = LoopbackServer(engine_options=options, **server_options)
    else:
        from kvserve.engine.engine import Engine
        server = LoopbackServer(Engine.from_options(**options), **server_options)
    yield server
    server.stop()


def _events(url: str, key: str = ADMIN, **params):
    """The events of one stream, as parsed JSON, until it ends."""
    with httpx.stream("GET", url + "/dashboard/events", params=params, headers={"Authorization": f"Bearer {key}"},
                      timeout=30) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: {}":
                yield json.loads(line[len("data: "):])


def _until(url: str, check, what: str, timeout: float = 30.0) -> dict:
    """The first event `check` accepts, across as many streams as it takes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in _events(url, hz=5):
            if check(event):
                return event
            if time.monotonic() > deadline:
                break
    raise AssertionError(f"no event showed {what} within {timeout} s")


def _complete(url: str, key: str, max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _gpu_counts(event: dict) -> dict:
    return event["kv_map"]["tiers"][0]["state_counts"]


def test_the_page_is_public_static_html_under_a_strict_policy(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert '<script src="/dashboard/static/dashboard.js"' in page.text and "sk-" not in page.text
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        response = httpx.get(f"{server.url}/dashboard/static/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
    for name in ("dashboard.html", "nope.js", "..%2Fdashboard.py", "%2E%2E%2Fapp.py"):
        assert httpx.get(f"{server.url}/dashboard/static/{name}").status_code == 404


def test_only_the_admin_key_opens_the_stream(server):
    url = server.url + "/dashboard/events"
    missing = httpx.get(url)
    assert missing.status_code == 401 and "admin" in missing.json()["error"]["message"]
    assert httpx.get(url, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
    tenant = httpx.get(url, headers={"Authorization": "Bearer sk-alice"})
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_key_required"
    for params in ({"hz": 50}, {"hz": 0}, {"cells": 10}, {"cells": 1 << 20}):
        response = httpx.get(url, params=params, headers={"Authorization": f"Bearer {ADMIN}"})
        assert response.status_code == 400, params
    first = next(_events(server.url))
    assert first["model"] == "tiny" and first["seq"] == 1


def test_events_carry_the_engine_map_and_gauges(server):
    event = next(_events(server.url, cells=64))
    kv_map, engine = event["kv_map"], event["engine"]
    snapshot = server.snapshot
    [gpu] = kv_map["tiers"]
    assert gpu["name"] == "gpu" and gpu["num_blocks"] == snapshot.num_blocks == engine["num_blocks"]
    assert len(gpu["states"]) <= 64 and gpu["blocks_per_cell"] == -(-snapshot.num_blocks // 64)
    assert sum(gpu["state_counts"].values()) == snapshot.num_blocks
    assert kv_map["block_states"][0] == "free" and "K/V" in gpu["kv_format"]
    assert kv_map["block_size"] == 16 and kv_map["kv_bytes_per_block"] > 0
    assert engine["prefix_cache"]["policy"] == kv_map["eviction_policy"] == "lru"
    assert isinstance(engine["config_events"], list) and "bandwidth" in engine
    assert event["interval_s"] >= 0.2 and kv_map["build_seconds"] < 1.0


def test_the_map_follows_requests_as_they_run_and_finish(server):
    before = _gpu_counts(next(_events(server.url)))
    done = threading.Event()
    results = {}

    def run() -> None:
        results["usage"] = _complete(server.url, "sk-alice", max_tokens=1500)["usage"]
        done.set()
    thread = threading.Thread(target=run)
    thread.start()
    try:
        running = _until(server.url, lambda e: any(r["state"] == "running" and r["gpu_blocks"] > 0
                                                   for r in e["kv_map"]["requests"]), "a running request")
        [request] = [r for r in running["kv_map"]["requests"] if r["state"] == "running"]
        assert request["tenant"] == "alice"
        counts = _gpu_counts(running)
        assert counts["running"] + counts["shared"] >= request["gpu_blocks"] > 0
        gpu = running["kv_map"]["tiers"][0]
        index = running["kv_map"]["requests"].index(request)
        assert index in gpu["requests"]                        # cells name the request that holds them
        assert running["engine"]["num_running"] >= 1
    finally:
        thread.join(120)
    assert done.is_set()
    finished = _until(server.url, lambda e: not e["kv_map"]["requests"] and _gpu_counts(e)["cached"] > before["cached"],
                      "its blocks cached after it finished")
    kv_map = finished["kv_map"]
    assert _gpu_counts(finished)["running"] == 0
    assert "alice" in kv_map["tenants"]

    def alice_tree(event: dict) -> bool:
        # Trees are rebuilt at most every TREES_INTERVAL_S and sent once per stream: wait for one
        # made after the request finished.
        trees = [t for t in event["kv_map"]["prefix_trees"] or [] if t["tenant"] == "alice"]
        return bool(trees) and trees[0]["num_blocks"] >= results["usage"]["prompt_tokens"] // 16
    _until(server.url, alice_tree, "alice's prefix tree with the request's prompt blocks")


def test_a_server_without_an_admin_key_refuses_the_stream(folder):
    from kvserve.engine.engine import Engine
    server = LoopbackServer(Engine.from_options(model=folder, max_model_len=1024, kv_cache_memory=1 << 20))
    try:
        response = httpx.get(server.url + "/dashboard/events")
        assert response.status_code == 403 and response.json()["error"]["code"] == "admin_key_not_set"
        assert httpx.get(server.url + "/dashboard").status_code == 200
    finally:
        server.stop()


@pytest.mark.slow
def test_serve_stops_soon_after_sigterm_with_a_stream_open(folder, tmp_path):
    """uvicorn gives open responses the whole --shutdown-timeout; a dashboard stream ends on its own
    well before that, so an open page does not hold the shutdown up."""
    serve = ServeProcess(["--model", folder, "--max-model-len", "1024", "--kv-cache-memory", "4MiB",
                          "--admin-api-key", ADMIN, "--shutdown-timeout", "60"], tmp_path / "serve.log")
    opened = threading.Event()

    def watch() -> None:
        try:
            for _ in _events(serve.url):
                opened.set()
        except httpx.HTTPError:
            pass
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert opened.wait(30), serve.log()
    started = time.monotonic()
    assert serve.stop() == 0, serve.log()
    assert time.monotonic() - started < STREAM_LIFETIME_S + 15, serve.log()

"""The live KV map in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright):
the page loads under its content policy, refuses a wrong or a tenant's key and connects with the
admin key, draws the GPU pool and the host tier cell by cell, and changes when requests run (blocks
held, requests listed) and finish (blocks cached, prefix trees, the host tier filling); colour modes
switch; the key survives a reload of the tab and is forgotten on request.

KVSERVE_DASHBOARD_SCREENSHOT=docs/images/kv_map.png writes the screenshot of the docs, taken with
requests in flight (python -m pytest tests/server/test_dashboard_browser.py)."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
CHROMIUM = "/usr/bin/chromium"
pytestmark = [requires_default_model,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")]

KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-carol": "carol"}
ADMIN = "sk-operator"
BLOCK = 16
SYSTEM = {"alice": "You are a careful assistant for the weather service. Answer briefly and cite the station. " * 5,
          "bob": "You translate support tickets into plain English, keeping product names as they are. " * 5,
          "carol": "You summarise meeting notes into action items with owners and due dates. " * 5}
WARM_TOKENS = 60
SCREENSHOT = os.environ.get("KVSERVE_DASHBOARD_SCREENSHOT")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-dashboard-browser"), max_position_embeddings=4096)
    files = tmp_path_factory.mktemp("dashboard-browser-keys")
    (files / "keys.json").write_text(json.dumps(KEYS))
    from kvserve.engine.engine import Engine
    probe = Engine.from_options(model=folder, max_model_len=1024, kv_cache_memory=1 << 20, block_size=BLOCK)
    block_bytes = probe.kv_bytes_per_token * BLOCK
    # A GPU pool small enough that cached prefixes are evicted to the host tier while the test runs.
    engine = Engine.from_options(model=folder, max_model_len=2048, block_size=BLOCK, kv_cache_memory=256 * block_bytes,
                                 kv_host_memory=960 * block_bytes)
    server = LoopbackServer(engine, api_keys_file=str(files / "keys.json"), admin_api_key=ADMIN)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def _complete(url: str, tenant: str, question: str, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": SYSTEM[tenant] + question, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    key = next(k for k, t in KEYS.items() if t == tenant)
    response = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    assert response.status_code == 200, response.text


def _until(page, expression: str, what: str, timeout: float = 60.0):
    """Polls `expression` in the page (the page's policy forbids the eval wait_for_function uses)."""
    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(expression)
        if value:
            return value
        assert time.monotonic() < deadline, f"the page never showed {what}"
        time.sleep(0.1)


def _connect(page, key: str) -> None:
    page.fill("#admin-key", key)
    page.click("#key-form button")


def test_the_page_shows_the_pool_and_follows_requests(server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # The page logs what it could not draw; refused keys' responses are logged by the browser itself.
    page.on("console", lambda message: errors.append(message.text) if message.type == "error"
            and not message.text.startswith("Failed to load resource") else None)
    page.goto(server.url + "/dashboard")
    assert page.is_visible("#key-form") and page.inner_text("#status") == "not connected"
    assert page.evaluate("window.kvMapState.events") == 0

    _connect(page, "sk-wrong")
    _until(page, "!document.getElementById('message').hidden", "the refusal of a wrong key")
    assert "401" in page.inner_text("#message") and page.is_visible("#key-form")
    _connect(page, "sk-alice")
    _until(page, "document.getElementById('message').textContent.includes('403')", "the refusal of a tenant's key")

    page.select_option("#rate", "4")
    _connect(page, ADMIN)
    _until(page, "window.kvMapState.events > 0", "a first event")
    assert page.evaluate("window.kvMapState.hz") == 4
    assert page.inner_text("#status") == "live" and not page.is_visible("#key-form")
    snapshot = server.snapshot
    gpu = page.evaluate("window.kvMapState.tiers.gpu")
    # A cell a block: the grid is the pool, every cell drawn.
    assert gpu["cells"] == gpu["drawnCells"] == gpu["numBlocks"] == snapshot.num_blocks and gpu["blocksPerCell"] == 1
    host = page.evaluate("window.kvMapState.tiers.host")
    assert host["drawnCells"] == host["numBlocks"] == 960
    painted = page.evaluate("""(() => { const c = document.querySelector('[data-tier=gpu] canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; })()""")
    assert painted > gpu["cells"]                               # at least a pixel a cell
    assert int(page.get_attribute("#gpu-used", "data-value")) == 0
    page.hover("[data-tier=gpu] canvas", position={"x": 2, "y": 2})
    assert page.is_visible("#tooltip") and page.inner_text("#tooltip").startswith("block 0\nfree")

    # Warm the caches: a conversation per tenant, cached, then pushed to the host tier by the next ones.
    pin = httpx.post(server.url + "/v1/prefix/pin", json={"model": "tiny", "prompt": SYSTEM["carol"], "ttl": 600},
                     headers={"Authorization": "Bearer sk-carol"}, timeout=30)
    assert pin.status_code == 200, pin.text
    for round_ in range(4):
        warm = [threading.Thread(target=_complete, args=(server.url, tenant, f" Question {round_}-{i}: " + "why? " * 80,
                                                         WARM_TOKENS))
                for i, tenant in enumerate(["alice", "bob", "carol", "alice", "bob"])]
        for thread in warm:
            thread.start()
        for thread in warm:
            thread.join(300)
    _until(page, "+document.getElementById('gpu-cached').dataset.value > 0", "cached prefixes")
    _until(page, "window.kvMapState.tiers.host.counts.cached > 0", "blocks the GPU evicted, in the host tier")

    # Requests in flight: held blocks, listed requests with their footprint. They generate more
    # tokens than any warm-up request did, so what the page shows of them is not the warm-up's.
    long_runs = [threading.Thread(target=_complete, args=(server.url, tenant, f" Long question {i}: tell me more.", 700))
                 for i, tenant in enumerate(["alice", "bob", "alice", "carol"])]
    long_running = f"window.kvMapState.last.kv_map.requests.filter(r => r.num_output_tokens > {WARM_TOKENS})"
    for thread in long_runs:
        thread.start()
    try:
        _until(page, f"+document.getElementById('gpu-used').dataset.value > 0 && {long_running}.length > 0",
               "blocks held by the long requests")
        assert int(page.get_attribute("#requests-count", "data-running")) >= 1
        assert page.locator("#requests tbody tr").count() >= 1
        assert "alice" in page.inner_text("#requests") or "bob" in page.inner_text("#requests")
        page.check("input[name=color][value=heat]")
        assert page.evaluate("window.kvMapState.colorMode") == "heat" and "cold" in page.inner_text("#legend")
        page.check("input[name=color][value=tenant]")
        _until(page, "document.getElementById('legend').textContent.includes('alice')", "tenants in the legend")
        page.check("input[name=color][value=owner]")
        if SCREENSHOT:
            _until(page, f"{long_running}.length >= 3", "three long requests in flight")
            page.screenshot(path=SCREENSHOT, full_page=True)
    finally:
        for thread in long_runs:
            thread.join(300)

    _until(page, "window.kvMapState.last.kv_map.requests.length === 0 && "
                 "+document.getElementById('gpu-used').dataset.value === 0", "the requests gone")
    assert int(page.get_attribute("#gpu-cached", "data-value")) > 0
    assert errors == []
    _until(page, "document.querySelectorAll('#trees .tree').length > 0", "prefix trees")
    assert "carol" in page.inner_text("#pins")                # the pin, by its tenant
    assert page.evaluate("window.kvMapState.tiers.gpu.counts.pinned") > 0
    assert "host tier" in page.inner_text("#hit-rates")
    assert errors == []

    # The key lives in the tab's sessionStorage: a reload connects at once; "Forget key" drops it.
    streams = page.evaluate("window.kvMapState.streams")
    page.reload()
    _until(page, "window.kvMapState.events > 0", "an event after a reload")
    assert not page.is_visible("#key-form")
    page.click("#forget-key")
    assert page.is_visible("#key-form") and page.evaluate("sessionStorage.length") == 0
    assert streams >= 1
    page.close()

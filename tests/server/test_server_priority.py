"""The `priority` request field through the HTTP server and the engine core process: with
--scheduling-policy priority and one request at a time, a high-priority request sent while a long
low-priority one streams preempts it and finishes first; the preempted one's text is unchanged."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-priority"), max_position_embeddings=2048)
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=1024, kv_cache_memory=8 << 20,
                                                scheduling_policy="priority", max_num_seqs=1))
    yield server.url
    server.stop()


def _body(max_tokens: int, priority: int, stream: bool = False) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "priority": priority, "stream": stream}


def test_a_high_priority_request_overtakes_a_streaming_low_priority_one(server):
    alone = httpx.post(server + "/v1/completions", json=_body(400, 5), timeout=120).json()["choices"][0]["text"]
    first_chunk, finished = threading.Event(), {}
    text = []

    def low() -> None:
        with httpx.stream("POST", server + "/v1/completions", json=_body(400, 5, stream=True), timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    first_chunk.set()
        finished["low"] = time.monotonic()

    thread = threading.Thread(target=low)
    thread.start()
    assert first_chunk.wait(60)
    response = httpx.post(server + "/v1/completions", json=_body(4, 0), timeout=60)
    finished["high"] = time.monotonic()
    thread.join(120)
    assert response.status_code == 200, response.text
    assert finished["high"] < finished["low"]
    assert "".join(text) == alone
    preemptions = [line for line in httpx.get(server + "/metrics").text.splitlines()
                   if line.startswith("kvserve:num_preemptions_total")]
    assert preemptions and float(preemptions[0].split()[-1]) >= 1


def test_a_priority_that_is_not_an_integer_is_a_400(server):
    response = httpx.post(server + "/v1/completions", json={**_body(4, 0), "priority": "high"}, timeout=60)
    assert response.status_code == 400 and "priority" in response.text

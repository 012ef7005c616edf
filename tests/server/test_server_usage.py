"""usage.prompt_tokens_details.cached_tokens, as OpenAI reports it: the prompt tokens whose KV came
from the prefix cache, exactly, through the engine core process and through an in-process engine,
for completions and chat, streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]

BLOCK = 16
PROMPT = "A long shared system prompt about the weather in many cities of the world. " * 8


@pytest.fixture(scope="module", params=["core-process", "in-process"])
def server(request, tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-usage"), max_position_embeddings=2048)
    options = dict(model=folder, max_model_len=1024, kv_cache_memory=8 << 20, block_size=BLOCK)
    if request.param == "core-process":
        server = LoopbackServer(engine_options=options)
    else:
        from kvserve.engine.engine import Engine
        server = LoopbackServer(Engine.from_options(**options))
    yield server.url
    server.stop()


def _usage(url: str, path: str, body: dict, stream: bool) -> dict:
    if not stream:
        response = httpx.post(url + path, json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    return [c for c in chunks if c.get("usage")][-1]["usage"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Hi"}]}),
])
def test_cached_tokens_are_the_prompt_tokens_the_prefix_cache_served(server, path, body, stream):
    body = {**body, "max_tokens": 2, "temperature": 0, "cache_salt": f"{path}-{stream}"}   # a cold cache each
    first = _usage(server, path, body, stream)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = _usage(server, path, body, stream)
    prompt = second["prompt_tokens"]
    # Whole blocks, leaving the last prompt token to compute.
    assert second["prompt_tokens_details"] == {"cached_tokens": (prompt - 1) // BLOCK * BLOCK}
    assert prompt == first["prompt_tokens"] and prompt > 3 * BLOCK

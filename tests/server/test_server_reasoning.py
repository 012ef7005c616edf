"""--reasoning-parser over HTTP: a chat reply's think goes to `reasoning_content`, the answer to
`content`, in a whole response and in stream deltas, with `usage.completion_tokens_details.
reasoning_tokens`. The model is a real 2-layer Llama rigged to answer every chat with one fixed
reply (tests/rigged_model.py), with the default model's tokenizer plus R1's `<think>` and
`</think>` tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer
from rigged_model import rigged_model

pytestmark = [pytest.mark.slow, requires_default_model]

THINK, ANSWER = "Let me see", "The answer is four"


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def server(request, tmp_path_factory):
    folder = rigged_model(tmp_path_factory.mktemp("rigged-think"), f"<think>{THINK}</think>{ANSWER}",
                          ["<think>", "</think>"])
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=512, kv_cache_memory=8 << 20),
                            reasoning_parser=request.param)
    yield server.url
    server.stop()


def _chat(url: str, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_the_think_goes_to_reasoning_content(server):
    reply = _chat(server).json()
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THINK, ANSWER)
    # <think>, Let, me, see, </think>
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


def test_a_think_cut_at_max_tokens_is_all_reasoning(server):
    message = _chat(server, max_tokens=3).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me" and message["content"] == ""


def test_streamed_deltas_carry_each_part(server):
    reasoning, content, usage = "", "", None
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk["choices"]:
                reasoning += choice["delta"].get("reasoning_content", "")
                content += choice["delta"].get("content", "")
            usage = chunk.get("usage") or usage
    assert (reasoning, content) == (THINK, ANSWER)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 5

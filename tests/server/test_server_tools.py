"""Tool calling over HTTP (tools + tool_choice), with the `openai` client.

With the default model and a Hermes-style tool template (hermes_tools.jinja, via --chat-template):
tool_choice required and a named function are constrained by the grammar, so every call parses and
its arguments validate against the tool's schema, streamed or not; an agent loop runs a call, sends
its result back as a `tool` message, and gets an answer. With a rigged model whose reply holds a
`<tool_call>` block (tests/rigged_model.py): tool_choice auto, read by --tool-call-parser hermes,
returns message.tool_calls and the content around them, streamed the same. Malformed tools are a
400 naming the field."""

from __future__ import annotations

import json
import pathlib

import httpx
import jsonschema
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer
from rigged_model import rigged_model

pytestmark = [pytest.mark.slow, requires_default_model]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TEMPLATE = pathlib.Path(__file__).with_name("hermes_tools.jinja")


@pytest.fixture(scope="module")
def server():
    server = LoopbackServer(engine_options=dict(max_model_len=1024, kv_cache_memory=64 << 20),
                            chat_template=str(TEMPLATE))
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_constrained_calls_parse_and_validate(client, choice):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=120)
    calls = reply.choices[0].message.tool_calls
    _check_calls(calls)
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    if isinstance(choice, dict):
        assert [call.function.name for call in calls] == ["get_time"]


def test_sampled_required_calls_always_parse(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=3, n=4, max_tokens=160, parallel_tool_calls=False)
    for choice in reply.choices:
        _check_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1


def test_streamed_calls_equal_the_whole_reply(client):
    fields = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**fields).choices[0].message.tool_calls
    streamed, finish = [], None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            streamed += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert [c.index for c in streamed] == list(range(len(whole))) and finish == "tool_calls"


def test_an_agent_loop_runs_a_tool_and_answers(client, server):
    def get_weather(city: str, unit: str) -> str:
        return f"18 degrees {unit} and sunny in {city}"
    messages = list(ASK)
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS[:1], tool_choice="required",
                                           temperature=0, max_tokens=120)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        result = get_weather(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS[:1], tool_choice="none",
                                            temperature=0, max_tokens=24)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens
    # what the model read: the tools, its own call (arguments as an object, not a quoted text), the result
    rendered = httpx.post(server + "/v1/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(server + "/v1/detokenize", json={"tokens": rendered}).json()["prompt"]
    arguments = json.loads(message.tool_calls[0].function.arguments)
    assert f'"arguments": {json.dumps(arguments)}}}</tool_call>' in text
    assert "<|im_start|>tool\n18 degrees" in text


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "auto"}, "tool_choice"),                 # auto needs --enable-auto-tool-choice
    ({}, "tool_choice"),                                      # so does the default
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]}, "tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(server, body, param):
    response = httpx.post(server + "/v1/chat/completions",
                          json={"messages": ASK, "max_tokens": 4, "tools": TOOLS, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


# --- tool_choice auto, read by --tool-call-parser hermes --------------------------------------------

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
REPLY = f"Let me check.<tool_call>{CALL}</tool_call>"


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory):
    folder = rigged_model(tmp_path_factory.mktemp("rigged-tools"), REPLY, ["<tool_call>", "</tool_call>", CALL])
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=512, kv_cache_memory=8 << 20),
                            tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield server.url
    server.stop()


def _auto(url: str, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()


def test_auto_reads_the_call_out_of_the_text(auto_server):
    choice = _auto(auto_server, tools=TOOLS)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "C"})}


def test_auto_streamed_equals_whole(auto_server):
    content, calls, finish = "", [], None
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0, "stream": True,
            "tools": TOOLS}
    with httpx.stream("POST", auto_server + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                content += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls") or []
                finish = choice["finish_reason"] or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and calls[0]["index"] == 0


@pytest.mark.parametrize("fields", [{}, {"tools": TOOLS, "tool_choice": "none"}], ids=["no-tools", "none"])
def test_without_tools_or_with_none_the_text_is_content(auto_server, fields):
    choice = _auto(auto_server, **fields)["choices"][0]
    assert choice["message"]["content"] == REPLY and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"

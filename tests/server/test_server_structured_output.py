"""Structured output over HTTP, through the engine core process, with the default model and the
`openai` client: response_format json_schema / json_object, vLLM's guided_* and structured_outputs
on both endpoints, streaming and non-streaming agreeing token for token, and every malformed
constraint a fast 400 naming its field (the engine keeps serving)."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer

pytestmark = [pytest.mark.slow, requires_default_model]

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 3}},
    "required": ["city", "population", "landmarks"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.fixture(scope="module")
def server():
    server = LoopbackServer(engine_options=dict(max_model_len=1024, kv_cache_memory=64 << 20))
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_response_format_json_schema_validates(client):
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_streaming_and_non_streaming_agree(client):
    fields = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=120,
                  response_format={"type": "json_object"})
    whole = client.chat.completions.create(**fields).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**fields, stream=True) if chunk.choices)
    assert streamed == whole and isinstance(json.loads(whole), dict)


@pytest.mark.parametrize("field,value,check", [
    ("guided_json", SCHEMA, lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    ("guided_regex", r"[A-Z][a-z]{2,9} \d{4}", lambda text: re.fullmatch(r"[A-Z][a-z]{2,9} \d{4}", text) or pytest.fail(text)),
    ("guided_choice", ["red", "green", "blue"], lambda text: text in ("red", "green", "blue") or pytest.fail(text)),
    ("guided_grammar", 'root ::= "The answer is " [0-9]{1,3} "."',
     lambda text: re.fullmatch(r"The answer is [0-9]{1,3}\.", text) or pytest.fail(text)),
    ("structured_outputs", {"choice": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta") or pytest.fail(text)),
])
def test_vllm_fields_on_both_endpoints(server, field, value, check):
    common = {"temperature": 0, "max_tokens": 120, field: value}
    chat = httpx.post(server + "/v1/chat/completions", json={"messages": MESSAGES, **common}, timeout=120)
    completion = httpx.post(server + "/v1/completions", json={"prompt": "Paris:", **common}, timeout=120)
    check(chat.json()["choices"][0]["message"]["content"])
    check(completion.json()["choices"][0]["text"])


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(40000))}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
])
def test_bad_constraints_are_a_fast_400_naming_the_field(server, body, param):
    started = time.monotonic()
    response = httpx.post(server + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, **body},
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    assert time.monotonic() - started < 5
    # the engine is still serving
    assert httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200

"""The real server on a loopback port, serving the default model (SmolLM2-135M-Instruct, CPU).

One module-scoped `kvserve serve` process tree (launcher, engine core process, front end) is
shared by every test, to keep CPU time low; the offline engine computed the reference outputs
first, in this process. Clients are the real
`openai` package for the happy paths and raw httpx for bad input, disconnects and /metrics.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from types import SimpleNamespace

import httpx
import pytest

from conftest import requires_default_model

# Both need the default model's GGUF (its tokenizer and chat template at least).
pytestmark = [pytest.mark.slow, requires_default_model]

API_KEY = "sk-test-key"
TENANT_KEY = "sk-tenant-a"
MAX_MODEL_LEN = 2048
MAX_REQUEST_BYTES = 256 * 1024
GREEDY_TOKENS = 12

COMPLETION_PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(16)]
CHAT_PROMPTS = [f"Name an animal whose name starts with the letter {chr(65 + i)}." for i in range(16)]
HELLO = "Hello, my name is"


# --------------------------------------------------------------------------------------------------
# fixture: offline references first, then the server around the same engine
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from loopback_server import ServeProcess, wait_gone

    from kvserve.sampling_params import SamplingParams
    from kvserve.llm import LLM

    llm = LLM(kv_cache_memory=256 << 20, max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0)
    # One offline batch for every reference (fewer engine steps than one call each); chats go
    # through LLM.apply_chat_template, which is what LLM.chat does.
    chats = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": p}])} for p in CHAT_PROMPTS]
    prompts = COMPLETION_PROMPTS + chats + [HELLO, HELLO]
    params = [greedy] * (len(COMPLETION_PROMPTS) + len(chats)) + [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, prompt_logprobs=2)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected_completions = [o.outputs[0] for o in outputs[:len(COMPLETION_PROMPTS)]]
    expected_chats = [o.outputs[0] for o in outputs[len(COMPLETION_PROMPTS):-2]]
    hello, echo = outputs[-2], outputs[-1]
    tokenizer, vocab = llm.engine.tokenizer, llm.engine.model.config.vocab_size
    del llm

    # The server is `kvserve serve` itself: launcher, engine core process and front end, so every
    # answer below crossed the process boundary and is compared with the offline engine's.
    folder = tmp_path_factory.mktemp("serve")
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps({TENANT_KEY: "tenant-a"}))
    process = ServeProcess(["--api-key", API_KEY, "--api-keys-file", str(keys_file), "--max-request-bytes",
                            str(MAX_REQUEST_BYTES), "--shutdown-timeout", "5", "--kv-cache-memory", "256MiB",
                            "--max-model-len", str(MAX_MODEL_LEN)], folder / "serve.log")
    yield SimpleNamespace(url=process.url, process=process, tokenizer=tokenizer, vocab=vocab,
                          expected_completions=expected_completions, expected_chats=expected_chats,
                          hello=hello, echo=echo, headers={"Authorization": f"Bearer {API_KEY}"})
    pids = process.tree()
    assert process.stop() == 0, process.log()
    assert not wait_gone(pids), "processes left behind"


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if not match:
            continue
        sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(sample_labels.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
            found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


def _wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


# --------------------------------------------------------------------------------------------------
# happy paths with the openai client
# --------------------------------------------------------------------------------------------------

def test_health_models_and_auth(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    # No key, a wrong key: 401 with an OpenAI error object. The tenant key works.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert r.status_code == 200
    import openai
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_completion_matches_offline_and_usage_is_exact(server, client):
    expected = server.hello.outputs[0]
    result = client.completions.create(model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=24, temperature=0)
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    prompt_len = len(server.tokenizer(HELLO)["input_ids"])
    assert result.usage.prompt_tokens == prompt_len
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.usage.total_tokens == prompt_len + len(expected.token_ids)

    # The same prompt as token ids gives the same completion.
    ids = server.tokenizer(HELLO)["input_ids"]
    by_ids = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_completion_stream_with_usage(server, client):
    expected = server.hello.outputs[0]
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_stop_string_is_cut_the_same_streamed_or_not(server, client):
    full = server.hello.outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = full[:full.find(stop)]
    plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=24, temperature=0,
                                      stop=[stop])
    assert plain.choices[0].text == want and plain.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=24,
                                         temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_chat_non_stream_and_stream_match_offline(server, client):
    expected = server.expected_chats[0]
    messages = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    result = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                            max_tokens=GREEDY_TOKENS, temperature=0)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.usage.completion_tokens == len(expected.token_ids)
    prompt_len = len(server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"])
    assert result.usage.prompt_tokens == prompt_len

    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                            max_completion_tokens=GREEDY_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_logprobs_and_sampling_options(server, client):
    result = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Say hi."}],
        max_tokens=5, temperature=0.7, top_p=0.9, seed=7, n=2, logprobs=True, top_logprobs=2,
        presence_penalty=0.5, frequency_penalty=0.5, stop=["\n\n"], user="test-user",
        extra_body={"top_k": 20, "min_p": 0.05, "priority": 1})
    assert [c.index for c in result.choices] == [0, 1]
    for choice in result.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 5
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    again = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Say hi."}],
        max_tokens=5, temperature=0.7, top_p=0.9, seed=7, n=2, presence_penalty=0.5, frequency_penalty=0.5,
        stop=["\n\n"], extra_body={"top_k": 20, "min_p": 0.05})
    assert [c.message.content for c in again.choices] == [c.message.content for c in result.choices]


def test_multi_prompt_completion_with_n(server, client):
    result = client.completions.create(model="SmolLM2-135M-Instruct", prompt=[HELLO, COMPLETION_PROMPTS[0]],
                                       max_tokens=4, temperature=0.8, seed=3, n=2)
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    prompt_tokens = sum(len(server.tokenizer(p)["input_ids"]) for p in (HELLO, COMPLETION_PROMPTS[0]))
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens <= 16
    # Streamed: every choice index shows up and finishes once.
    finished = {}
    for chunk in client.completions.create(model="SmolLM2-135M-Instruct", prompt=[HELLO, COMPLETION_PROMPTS[0]],
                                           max_tokens=4, temperature=0, n=2, stream=True):
        for choice in chunk.choices:
            if choice.finish_reason:
                finished[choice.index] = finished.get(choice.index, 0) + 1
    assert finished == {0: 1, 1: 1, 2: 1, 3: 1}


def test_echo_logprobs_in_lm_eval_shape(server):
    """lm-eval local-completions: token ids in, echo + logprobs + max_tokens=1, reads
    token_logprobs[ctxlen:-1] and top_logprobs[ctxlen:-1] (greedy check)."""
    ids = list(server.echo.prompt_token_ids)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": [ids], "max_tokens": 1, "temperature": 0,
            "logprobs": 2, "echo": True, "seed": 1234}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"].startswith(server.tokenizer.decode(ids))
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    offline = server.echo.prompt_logprobs
    for position in range(1, len(ids)):
        assert lp["token_logprobs"][position] == pytest.approx(offline[position][ids[position]], abs=1e-4)
        top = lp["top_logprobs"][position]
        assert lp["tokens"][position] in top and max(top.values()) >= lp["token_logprobs"][position]
    # What lm-eval computes from it.
    ctxlen = 2
    continuation = lp["token_logprobs"][ctxlen:-1]
    assert sum(continuation) == pytest.approx(sum(offline[p][ids[p]] for p in range(ctxlen, len(ids))), abs=1e-3)


def test_tokenize_and_detokenize(server):
    r = httpx.post(server.url + "/v1/tokenize", json={"prompt": HELLO}, headers=server.headers)
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    assert tokens == server.tokenizer(HELLO)["input_ids"] and r.json()["count"] == len(tokens)
    r = httpx.post(server.url + "/v1/detokenize", json={"tokens": tokens}, headers=server.headers)
    assert r.json() == {"prompt": HELLO}
    r = httpx.post(server.url + "/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                   headers=server.headers)
    assert r.status_code == 200 and r.json()["count"] > 3


def test_32_concurrent_streams_equal_offline_greedy(server):
    import openai

    async def one_completion(client, prompt):
        text, usage = "", None
        stream = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                                 max_tokens=GREEDY_TOKENS, temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage.completion_tokens

    async def one_chat(client, prompt):
        text, usage = "", None
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}],
            max_tokens=GREEDY_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        return text, usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as client:
            jobs = [one_completion(client, p) for p in COMPLETION_PROMPTS] + [one_chat(client, p) for p in CHAT_PROMPTS]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    expected = server.expected_completions + server.expected_chats
    assert len(results) == 32
    for (text, num_tokens), want in zip(results, expected):
        assert text == want.text
        assert num_tokens == len(want.token_ids)


# --------------------------------------------------------------------------------------------------
# bad input: raw httpx
# --------------------------------------------------------------------------------------------------

def _long_ids(n):
    return [100 + (i % 1000) for i in range(n)]


BAD_INPUTS = [
    # (name, path, body: dict | bytes, status, words the message must contain)
    ("malformed json", "/v1/completions", b'{"prompt": "hi",', 400, "malformed JSON"),
    ("empty body", "/v1/completions", b"", 400, "empty"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe hi"}', 400, "UTF-8"),
    ("lone surrogate", "/v1/completions", b'{"prompt": "\\ud800"}', 400, "surrogate"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens float", "/v1/completions", {"prompt": "hi", "max_tokens": 3.5}, 400, "max_tokens"),
    ("stream wrong type", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404, "gpt-4o"),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("temperature < 0", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("n too large", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n must be at most"),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("seed out of range", "/v1/completions", {"prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
    ("presence penalty", "/v1/completions", {"prompt": "hi", "presence_penalty": 9}, 400, "presence_penalty"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("empty prompt string", "/v1/completions", {"prompt": ""}, 400, "empty"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 10 ** 9]}, 400, "token ids"),
    ("prompt ids too long", "/v1/completions", {"prompt": _long_ids(MAX_MODEL_LEN + 10)}, 400,
     "maximum context length"),
    ("prompt text too long", "/v1/completions", {"prompt": "hello " * (MAX_MODEL_LEN + 10)}, 400,
     "maximum context length"),
    ("prompt + max_tokens too long", "/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400,
     "maximum context length"),
    ("too many stop strings", "/v1/completions", {"prompt": "hi", "stop": ["x"] * 100}, 400, "stop"),
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("logit_bias", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("invalid role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("content wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "content"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat unknown model", "/v1/chat/completions",
     {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}, 404, "llama"),
    ("chat top_logprobs alone", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat max_completion_tokens 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400, "max_tokens"),
    ("chat too long", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 10)}]}, 400, "maximum context length"),
    ("chat tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ("detokenize bad id", "/v1/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("tokenize neither", "/v1/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize("name,path,body,status,words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_an_openai_error(server, name, path, body, status, words):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers={**server.headers, "Content-Type": "application/json"},
                   timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words.lower() in error["message"].lower()
    assert "Traceback" not in r.text and 'File "' not in r.text and ".py" not in r.text


def test_bad_inputs_never_reach_the_engine_and_server_keeps_serving(server, client):
    before = _metrics(server)
    prompt_tokens = metric_value(before, "kvserve:prompt_tokens_total")
    for _, path, body, _, _ in BAD_INPUTS:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.post(server.url + path, headers={**server.headers, "Content-Type": "application/json"}, timeout=30,
                   **kwargs)
    after = _metrics(server)
    assert metric_value(after, "kvserve:prompt_tokens_total") == prompt_tokens
    assert metric_value(after, "kvserve:num_requests_waiting") == 0
    assert metric_value(after, "kvserve:http_request_errors_total", status_code="400") >= len(BAD_INPUTS) - 5
    assert client.completions.create(model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=2,
                                     temperature=0).choices[0].text


def test_oversized_body_is_refused_before_reading(server):
    big = b'{"prompt": "' + b"a" * (MAX_REQUEST_BYTES + 1000) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, timeout=30,
                   headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    # Declared too large: answered from the header alone, without sending the body.
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100000000\r\n\r\n{")
        reply = conn.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing", headers=server.headers)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions", headers=server.headers)
    assert r.status_code == 405 and "error" in r.json()


# --------------------------------------------------------------------------------------------------
# disconnects free KV blocks at once
# --------------------------------------------------------------------------------------------------

def _blocks_used(server) -> float:
    return metric_value(_metrics(server), "kvserve:kv_cache_blocks_used")


def test_stream_disconnect_aborts_and_frees_blocks(server):
    assert _wait_for(lambda: _blocks_used(server) == 0)
    aborted_before = metric_value(_metrics(server), "kvserve:request_success_total", finished_reason="abort")
    body = {"prompt": "Tell me a very long story about a dragon.", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as response:
            assert response.status_code == 200
            # Keep the iterator alive: closing it (e.g. `break` in a for loop) closes the connection.
            lines = response.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data: ")
            assert _blocks_used(server) > 0
            assert metric_value(_metrics(server), "kvserve:num_requests_running") == 1
    # The connection is closed without reading the rest.
    assert _wait_for(lambda: _blocks_used(server) == 0, timeout=15), "blocks did not come back"
    text = _metrics(server)
    assert metric_value(text, "kvserve:num_requests_running") == 0
    assert metric_value(text, "kvserve:request_success_total", finished_reason="abort") == aborted_before + 1


def test_non_stream_disconnect_aborts_and_frees_blocks(server):
    assert _wait_for(lambda: _blocks_used(server) == 0)
    # ~2000 tokens take seconds even on an H200 (1500 once finished inside a 2 s timeout there).
    body = {"prompt": "Tell me a very long story about a cat.", "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=0.5)
    assert _wait_for(lambda: _blocks_used(server) == 0, timeout=15), "blocks did not come back"


# --------------------------------------------------------------------------------------------------
# metrics, schema, CLI
# --------------------------------------------------------------------------------------------------

def test_metrics_names_and_histograms(server):
    from kvserve.obs.metrics import METRIC_NAMES
    text = _metrics(server)
    for name in METRIC_NAMES:
        assert name in text, name
    assert metric_value(text, "kvserve:time_to_first_token_seconds_count") > 0
    assert metric_value(text, "kvserve:time_per_output_token_seconds_count") > 0
    assert metric_value(text, "kvserve:e2e_request_latency_seconds_count") > 0
    assert metric_value(text, "kvserve:generation_tokens_total") > 0
    assert metric_value(text, "kvserve:kv_cache_blocks_total") > 0
    assert 0 <= metric_value(text, "kvserve:kv_cache_usage_perc") <= 1
    assert metric_value(text, "kvserve:request_success_total", finished_reason="length") > 0


def test_openapi_schema_describes_request_bodies(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_serve_flags_map_onto_server_and_engine_config(tmp_path):
    from kvserve.cli import build_parser
    from kvserve.config import engine_options_from_args
    from kvserve.server.config import server_config_from_args
    keys = tmp_path / "keys.json"
    keys.write_text('{"k1": "team-a", "k2": "team-b"}')
    args = build_parser().parse_args(["serve", "--port", "9001", "--api-key", "secret", "--api-keys-file",
                                      str(keys), "--max-request-bytes", "1MiB", "--served-model-name", "m",
                                      "--kv-cache-memory", "64MiB", "--max-num-seqs", "8"])
    config = server_config_from_args(args)
    assert (config.host, config.port, config.max_request_bytes, config.served_model_name) == \
        ("127.0.0.1", 9001, 1 << 20, ["m"])
    assert config.load_api_keys() == {"k1": "team-a", "k2": "team-b", "secret": None}
    options = engine_options_from_args(args)
    assert options["kv_cache_memory"] == 64 << 20 and options["max_num_seqs"] == 8
    assert "port" not in options


def test_serve_takes_the_model_as_vllm_does_and_several_names(tmp_path, capsys):
    from kvserve.cli import build_parser, main
    from kvserve.server.config import server_config_from_args
    args = build_parser().parse_args(["serve", "some/folder", "--served-model-name", "r1", "deepseek-r1"])
    assert args.model_tag == "some/folder"
    assert server_config_from_args(args).served_model_name == ["r1", "deepseek-r1"]
    with pytest.raises(SystemExit) as exited:
        main(["serve", "a", "--model", "b"])
    assert exited.value.code == 2 and "the model is given twice" in capsys.readouterr().err


def test_chat_template_flag_reads_a_file_or_takes_the_template(tmp_path):
    from kvserve.engine.chat_template import read_chat_template
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))

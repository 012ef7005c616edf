"""API fuzzing (schemathesis, bounded) and shutdown behaviour, on a tiny random model.

The model is a 2-layer Llama with random weights but the default model's real tokenizer and chat
template, so every endpoint does its full work (tokenize, chat template, sampling, streaming) in
milliseconds, and max_model_len is small so any request the fuzzer makes up is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

# Both need the default model's GGUF (its tokenizer and chat template at least).
pytestmark = [pytest.mark.slow, requires_default_model]

FUZZ_EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "40"))
FUZZ_SECONDS = float(os.environ.get("KVSERVE_FUZZ_SECONDS", "45"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-with-tokenizer"), max_position_embeddings=4096)


def _serve_tiny(model: str, max_model_len: int, **server_options) -> LoopbackServer:
    from kvserve.engine.engine import Engine
    engine = Engine.from_options(model=model, max_model_len=max_model_len, kv_cache_memory=16 << 20)
    return LoopbackServer(engine, **server_options)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model):
    # Through the engine core process, as `kvserve serve` runs it.
    server = LoopbackServer(engine_options=dict(model=tiny_model, max_model_len=96, kv_cache_memory=16 << 20))
    yield server
    server.stop()


def test_fuzz_api_finds_no_server_errors(fuzz_server):
    """Schema-driven positive and negative requests against every operation: never a 5xx, never a
    hang, never a traceback in a body; the server is healthy and the KV cache empty afterwards."""
    import hypothesis
    import schemathesis
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    failures: list[str] = []
    deadline = time.monotonic() + FUZZ_SECONDS
    settings = hypothesis.settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                                   suppress_health_check=list(hypothesis.HealthCheck),
                                   phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
    operations = [result.ok() for result in schema.get_all_operations()]
    num_calls = 0
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode)

            @settings
            @hypothesis.given(case=strategy)
            def check(case):
                nonlocal num_calls
                if time.monotonic() > deadline:
                    return
                response = case.call(base_url=fuzz_server.url, timeout=30)
                num_calls += 1
                if response.status_code >= 500 or "Traceback" in response.text:
                    failures.append(f"{case.method} {case.path} {mode.value}: {response.status_code} "
                                    f"{response.text[:300]} <- {case.body!r:.300}")

            try:
                check()
            except hypothesis.errors.Unsatisfiable:
                pass   # nothing to make invalid (e.g. a GET without parameters)
    assert not failures, "\n".join(failures[:10])
    assert num_calls >= 50
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    snapshot = fuzz_server.app.state.async_engine.snapshot
    assert snapshot.num_free_blocks == snapshot.num_blocks and snapshot.num_running == 0


def test_graceful_shutdown_finishes_short_requests_and_errors_long_ones(tiny_model):
    server = _serve_tiny(tiny_model, max_model_len=4096, shutdown_timeout=1.0)
    results: dict[str, object] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0}
        lines = []
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)
            results[name] = lines
        except httpx.HTTPError as exc:
            results[name] = exc

    threads = [threading.Thread(target=stream, args=("short", 40)),
               threading.Thread(target=stream, args=("long", 4000))]
    for thread in threads:
        thread.start()
    # Both requests are in the engine before shutdown starts.
    deadline = time.monotonic() + 20
    while server.app.state.async_engine.snapshot.num_running < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    took = server.stop(timeout=30)
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), "a client hung"
    assert took < 15
    short = results["short"]
    assert isinstance(short, list) and "data: [DONE]" in short
    assert sum(1 for line in short if line.startswith("data: {")) >= 2
    long = results["long"]
    # Cut off: the connection closes mid-stream (an error for the client), never a clean finish.
    assert isinstance(long, Exception) or "data: [DONE]" not in long
    assert not server.engine.has_unfinished_requests()
    assert server.engine.kv_manager.num_free_blocks == server.engine.kv_manager.num_blocks


def test_serve_command_runs_and_stops_on_sigint(tiny_model, tmp_path):
    """`kvserve serve` end to end: flags, API key, a request, then SIGINT -> clean exit."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"team-key": "team"}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", tiny_model, "--port", str(port),
                             "--api-keys-file", str(keys), "--served-model-name", "tiny-served",
                             "--kv-cache-memory", "8MiB", "--max-model-len", "128"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "kvserve serve did not come up"
            time.sleep(0.2)
        auth = {"Authorization": "Bearer team-key"}
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny-served"
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=30,
                       json={"model": "tiny-served", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, proc.stdout.read()

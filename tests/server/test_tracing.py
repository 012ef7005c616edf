"""Request traces over OTLP/HTTP (--otlp-traces-endpoint) into a real receiver that decodes them with
opentelemetry-proto: a request whose prefix comes back from the host tier and whose prompt runs in
chunks gives one `llm_request` span (a child of the caller's W3C traceparent) with a span per phase
under it, in order and inside it; an unsampled traceparent exports nothing; tracing changes no
output. Through the engine core process and through an in-process engine."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model
from otlp_receiver import OTLPReceiver

pytestmark = [pytest.mark.slow, requires_default_model]

BLOCK = 16
CHUNK = 48                                   # the prefill token budget: a 200-token prompt runs in 5 chunks
PROMPT = list(range(100, 300))               # 12 full blocks before its last token
# The traced requests: PROMPT's 12 blocks (from the host tier) and 108 more tokens of their own
# (no cache holds them), computed in 3 chunks.
CONTINUED = {False: PROMPT + list(range(5000, 5100)), True: PROMPT + list(range(6000, 6100))}
FILLERS = [list(range(1000 + 300 * i, 1200 + 300 * i)) for i in range(2)]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-tracing"), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def receiver():
    receiver = OTLPReceiver()
    yield receiver
    receiver.stop()


def _options(folder: str) -> dict:
    from kvserve.engine.engine import Engine
    probe = Engine.from_options(model=folder, block_size=BLOCK, kv_cache_memory=1 << 20)
    block_bytes = probe.kv_bytes_per_token * BLOCK
    # Room for one prompt and a little: each filler pushes the one before out to the host tier.
    return dict(model=folder, block_size=BLOCK, kv_cache_memory=block_bytes * 20, kv_host_memory=block_bytes * 64,
                max_num_batched_tokens=CHUNK, max_model_len=320)


@pytest.fixture(scope="module", params=["core-process", "in-process"])
def server(request, folder, receiver):
    options = _options(folder)
    if request.param == "core-process":
        server = LoopbackServer(engine_options=options, otlp_traces_endpoint=receiver.url)
    else:
        from kvserve.engine.engine import Engine
        server = LoopbackServer(Engine.from_options(**options), otlp_traces_endpoint=receiver.url)
    yield server
    server.stop()


def _complete(url: str, prompt: list[int], headers: dict = None, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    response = httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _host_hit_request(url: str, traceparent: str, stream: bool = False) -> str:
    """PROMPT computed, pushed to the host tier by the fillers, then CONTINUED (the traced run)."""
    _complete(url, PROMPT)
    for filler in FILLERS:
        _complete(url, filler)
    headers = {"traceparent": traceparent}
    if not stream:
        return _complete(url, CONTINUED[stream], headers)["choices"][0]["text"]
    body = {"prompt": CONTINUED[stream], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                import json
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_host_tier_hit_in_chunks_gives_a_span_per_phase_under_the_callers_span(server, receiver, stream):
    trace_id = TRACE_ID[:-2] + ("01" if stream else "02")
    _host_hit_request(server.url, f"00-{trace_id}-{PARENT_SPAN_ID}-01", stream)
    spans = receiver.wait_for(lambda got: any(s.trace_id == trace_id and s.name == "llm_request" for s in got))
    spans = receiver.trace(trace_id)
    (root,) = [s for s in spans if s.name == "llm_request"]
    assert root.parent_span_id == PARENT_SPAN_ID and root.service == "kvserve"
    assert root.attributes["gen_ai.usage.prompt_tokens"] == len(CONTINUED[stream])
    assert root.attributes["gen_ai.usage.completion_tokens"] == 6
    assert root.attributes["kvserve.cached_tokens"] == 12 * BLOCK          # every full block, from the host
    assert root.attributes["kvserve.kv_format"]
    children = [s for s in spans if s is not root]
    assert all(s.parent_span_id == root.span_id for s in children)
    assert all(root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns for s in children)
    by_name: dict[str, list] = {}
    for span in sorted(children, key=lambda s: s.start_ns):
        by_name.setdefault(span.name, []).append(span)
    assert set(by_name) == {"queued", "tier_lookup", "kv_load", "prefill_chunk", "decode", "stream_end"}
    lookup, = by_name["tier_lookup"]
    assert lookup.attributes["kvserve.host_blocks"] == 12 and lookup.attributes["kvserve.gpu_blocks"] == 0
    load, = by_name["kv_load"]
    assert load.attributes["kvserve.tier"] == "host" and load.attributes["kvserve.kind"] == "prefix"
    assert load.attributes["kvserve.blocks"] == 12 and load.attributes["kvserve.bytes"] > 0
    assert load.attributes["kvserve.ok"] is True
    # The host supplied 192 tokens; the other 108 run in chunks of the 48-token budget, after the load.
    chunks = by_name["prefill_chunk"]
    assert [c.attributes["kvserve.tokens"] for c in chunks] == [48, 48, 12]
    assert [c.attributes["kvserve.first_position"] for c in chunks] == [192, 240, 288]
    assert load.end_ns <= chunks[0].start_ns
    assert all(a.end_ns <= b.start_ns for a, b in zip(chunks, chunks[1:]))
    decode, = by_name["decode"]
    assert chunks[-1].end_ns <= decode.start_ns
    steps = [e for e in decode.events if e[0] == "decode_step"]
    assert len(steps) >= 4 and all(0 < e[2]["kvserve.bandwidth_utilization"] for e in steps)
    assert all(decode.start_ns <= e[1] <= decode.end_ns for e in steps)
    assert by_name["queued"][0].end_ns <= load.start_ns
    assert by_name["stream_end"][0].start_ns >= decode.start_ns


def test_a_cold_prompt_runs_in_chunks(server, receiver):
    trace_id = TRACE_ID[:-2] + "03"
    prompt = list(range(2000, 2200))
    _complete(server.url, prompt, {"traceparent": f"00-{trace_id}-{PARENT_SPAN_ID}-01"})
    receiver.wait_for(lambda got: any(s.trace_id == trace_id and s.name == "llm_request" for s in got))
    chunks = sorted((s for s in receiver.trace(trace_id) if s.name == "prefill_chunk"), key=lambda s: s.start_ns)
    assert [c.attributes["kvserve.tokens"] for c in chunks] == [48, 48, 48, 48, 8]
    assert [c.attributes["kvserve.first_position"] for c in chunks] == [0, 48, 96, 144, 192]
    assert all(a.end_ns <= b.start_ns for a, b in zip(chunks, chunks[1:]))


def test_without_a_traceparent_the_request_is_a_root_and_an_unsampled_one_exports_nothing(server, receiver):
    unsampled = TRACE_ID[:-2] + "04"
    _complete(server.url, [7, 8, 9], {"traceparent": f"00-{unsampled}-{PARENT_SPAN_ID}-00"})
    before = {s.span_id for s in receiver.spans}
    _complete(server.url, [7, 8, 9, 10])
    spans = receiver.wait_for(lambda got: any(s.name == "llm_request" and s.span_id not in before
                                              and s.parent_span_id == "" for s in got))
    time.sleep(1.5)                      # one more export round: an unsampled trace would be out by now
    assert receiver.trace(unsampled) == []
    assert any(s.name == "llm_request" and s.parent_span_id == "" and s.span_id not in before for s in spans)


def test_tracing_changes_no_output(server, folder):
    """The same greedy text with and without tracing (a server of the same options, untraced)."""
    traced = _complete(server.url, PROMPT[:40])["choices"][0]["text"]
    from kvserve.engine.engine import Engine
    plain = LoopbackServer(Engine.from_options(**_options(folder)))
    try:
        assert _complete(plain.url, PROMPT[:40])["choices"][0]["text"] == traced
    finally:
        plain.stop()


def test_a_bad_endpoint_is_refused_at_start():
    from kvserve.server.config import ServerConfig
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ServerConfig(otlp_traces_endpoint="127.0.0.1:4318").validate()

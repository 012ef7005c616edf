"""Hardening of the HTTP server against web pages, other tenants and hostile bodies (issue 23).

A tiny random Llama with the default model's real tokenizer keeps every request in milliseconds.
Its chat template is the default model's plus a few hooks these tests drive through
chat_template_kwargs: `note` is rendered, `refuse` makes the template call raise_exception, and a
non-integer `count` makes it raise a Python TypeError inside range(); a message's `name` is
rendered too. Several small servers run side by side, one per server configuration:

- `open_server`: no API keys (what `kvserve serve` is out of the box);
- `keyed_server`: an --api-keys-file with two tenants and a key mapped to null, plus --api-key;
- `gateway_server`: --trust-request-tenant (a trusted gateway sets the tenant in the body);
- `named_server`: --allowed-hosts api.internal.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from fastapi.routing import APIRoute

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b", "sk-null": None}
ADMIN_KEY = "sk-admin"
TEMPLATE_HOOKS = ("{% if note is defined %}[note: {{ note }}]{% endif %}"
                  "{% if refuse is defined %}{{ raise_exception('refused: ' ~ refuse) }}{% endif %}"
                  "{% if count is defined %}{% for i in range(count) %}.{% endfor %}{% endif %}"
                  "{% for m in messages %}{% if m.name is defined %}[name: {{ m.name }}]{% endif %}{% endfor %}")
SYSTEM = ("You are the support assistant of a company that sells storage appliances. Answer briefly, "
          "cite the manual section when you can, and never promise delivery dates. ") * 3
HI = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

# A valid body for every POST route: each must refuse it when it is not labelled as JSON.
VALID_BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": HI, "max_tokens": 1},
    "/v1/tokenize": {"prompt": "hi"},
    "/tokenize": {"prompt": "hi"},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/prefix/pin": {"prompt": SYSTEM, "ttl": 60},
    "/v1/prefix/unpin": {"id": 1},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import transformers
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-hardening"), max_position_embeddings=2048)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = tokenizer.chat_template + TEMPLATE_HOOKS
    tokenizer.save_pretrained(folder)
    return folder


def _serve(model: str, **server_options) -> LoopbackServer:
    """Through the engine core process, as `kvserve serve` runs it."""
    return LoopbackServer(engine_options=dict(model=model, max_model_len=1024, kv_cache_memory=8 << 20),
                          **server_options)


@pytest.fixture(scope="module")
def open_server(tiny_model):
    server = _serve(tiny_model)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("hardening-keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    server = _serve(tiny_model, api_keys_file=str(keys), api_key=ADMIN_KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway_server(tiny_model):
    server = _serve(tiny_model, trust_request_tenant=True)
    yield server
    server.stop()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match:
            return float(match.group(2))
    raise AssertionError(f"{name} not in /metrics")


def _post(server, path: str, body, key: str = None, **headers) -> httpx.Response:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.url + path, content=json.dumps(body).encode(), headers={**JSON, **headers}, timeout=60)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# --------------------------------------------------------------------------------------------------
# 1. a web page cannot drive the server: JSON bodies only, no CORS, no foreign Host
# --------------------------------------------------------------------------------------------------

def test_every_post_route_is_in_the_table(open_server):
    posts = {route.path for route in open_server.app.routes if isinstance(route, APIRoute) and "POST" in route.methods}
    # The operator's POST route answers 403 on this server (no admin key) before it reads a body;
    # tests/server/test_admin_config.py checks its content type with the key.
    assert posts == set(VALID_BODIES) | {"/v1/admin/config"}


# Bodies a browser sends to any origin without a CORS preflight, then other non-JSON labels.
NOT_JSON = ["text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=xyz", "text/json", "application/jsonx", "application/reports+json"]


@pytest.mark.parametrize("content_type", NOT_JSON)
def test_post_routes_refuse_bodies_not_labelled_json(open_server, content_type):
    tokens_before = _metric(open_server.url, "kvserve:prompt_tokens_total")
    for path, body in VALID_BODIES.items():
        response = httpx.post(open_server.url + path, content=json.dumps(body).encode(),
                              headers={"Content-Type": content_type}, timeout=30)
        error = _error(response, 415)
        assert content_type in error["message"] and "application/json" in error["message"], path
        assert error["code"] == "unsupported_media_type"
    assert _metric(open_server.url, "kvserve:prompt_tokens_total") == tokens_before
    assert httpx.get(open_server.url + "/v1/prefix/pins").json()["data"] == []


def test_post_without_content_type_is_refused(open_server):
    for path, body in VALID_BODIES.items():
        response = httpx.post(open_server.url + path, content=json.dumps(body).encode(), timeout=30)
        assert "Content-Type" in _error(response, 415)["message"], path


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON", "application/json; charset=utf-8",
                                          'application/json;charset="UTF-8"', "application/json ; foo=bar"])
def test_json_content_types_are_accepted(open_server, content_type):
    response = httpx.post(open_server.url + "/v1/tokenize", content=b'{"prompt": "hi"}',
                          headers={"Content-Type": content_type})
    assert response.status_code == 200, response.text


def test_a_charset_other_than_utf8_is_refused(open_server):
    response = httpx.post(open_server.url + "/v1/tokenize", content=b'{"prompt": "hi"}',
                          headers={"Content-Type": "application/json; charset=latin-1"})
    assert "latin-1" in _error(response, 415)["message"]


def test_no_cross_origin_access_is_granted(open_server):
    """No CORS middleware: a page on another origin can neither pass a preflight nor read a reply."""
    preflight = httpx.options(open_server.url + "/v1/completions", headers={
        "Origin": "https://attacker.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code >= 400
    assert not any(name.lower().startswith("access-control-") for name in preflight.headers)
    reply = _post(open_server, "/v1/tokenize", {"prompt": "hi"}, Origin="https://attacker.example")
    assert reply.status_code == 200
    assert not any(name.lower().startswith("access-control-") for name in reply.headers)


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.1.nip.io", "192.168.1.5"])
def test_a_foreign_host_header_is_refused_on_a_loopback_server(open_server, host):
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 is same-origin with the server
    (no preflight, readable replies) but still sends its own name in Host."""
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/v1/prefix/pins"),
                         ("GET", "/metrics"), ("GET", "/openapi.json")):
        response = httpx.request(method, open_server.url + path, headers={**JSON, "Host": host},
                                 content=b'{"prompt": "hi", "max_tokens": 1}' if method == "POST" else None)
        error = _error(response, 403)
        assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"], path


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "[::1]:8000"])
def test_loopback_host_names_are_served(open_server, host):
    assert httpx.get(open_server.url + "/v1/models", headers={"Host": host}).status_code == 200


def test_allowed_hosts_flag_names_the_hosts_served(tiny_model):
    server = _serve(tiny_model, allowed_hosts="api.internal, Other.Example")
    try:
        for host, status in (("api.internal", 200), ("api.internal:443", 200), ("other.example", 200),
                             ("127.0.0.1", 403), ("attacker.example", 403)):
            assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == status, host
    finally:
        server.stop()


def test_allowed_hosts_defaults_and_wildcard():
    from kvserve.server.config import ServerConfig
    assert ServerConfig().allowed_host_names() == frozenset({"localhost", "127.0.0.1", "::1"})
    assert ServerConfig(host="::1").allowed_host_names() == frozenset({"localhost", "127.0.0.1", "::1"})
    assert ServerConfig(host="0.0.0.0").allowed_host_names() is None
    assert ServerConfig(allowed_hosts="*").allowed_host_names() is None
    assert ServerConfig(host="0.0.0.0", allowed_hosts="a.example").allowed_host_names() == frozenset({"a.example"})
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServerConfig(allowed_hosts=" , ").validate()


# --------------------------------------------------------------------------------------------------
# 2. tenants come from API keys; the body's tenant only behind --trust-request-tenant
# --------------------------------------------------------------------------------------------------

def _chat_hits(server, body_extra: dict, key: str = None) -> tuple[httpx.Response, float]:
    before = _metric(server.url, "kvserve:prefix_cache_hits_total")
    response = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the reset?"}],
        "max_tokens": 1, "temperature": 0, **body_extra}, key)
    return response, _metric(server.url, "kvserve:prefix_cache_hits_total") - before


def test_without_keys_the_body_cannot_pick_a_tenant(open_server):
    error = _error(_chat_hits(open_server, {"tenant": "victim"})[0], 403)
    assert error["param"] == "tenant" and error["code"] == "tenant_not_allowed"
    assert "--trust-request-tenant" in error["message"]
    for path, body in (("/v1/completions", {"prompt": "hi", "tenant": "victim"}),
                       ("/v1/prefix/pin", {"prompt": SYSTEM, "tenant": "victim"}),
                       ("/v1/prefix/unpin", {"id": 1, "tenant": "victim"})):
        assert _error(_post(open_server, path, body), 403)["param"] == "tenant", path
    response = httpx.get(open_server.url + "/v1/prefix/pins", params={"tenant": "victim"})
    assert _error(response, 403)["param"] == "tenant"


def test_a_key_without_a_tenant_cannot_claim_one(keyed_server):
    """The timing probe of the issue: tenant-a caches its system prompt; nobody else may run in
    tenant-a's namespace (and hit it), see its pins or remove them."""
    response, hits = _chat_hits(keyed_server, {}, "sk-a")
    assert response.status_code == 200 and hits == 0
    response, hits = _chat_hits(keyed_server, {"tenant": "tenant-a"}, "sk-a")   # its own tenant: fine
    assert response.status_code == 200 and hits > 0
    for key in ("sk-null", ADMIN_KEY, "sk-b"):
        response, hits = _chat_hits(keyed_server, {"tenant": "tenant-a"}, key)
        assert _error(response, 403)["param"] == "tenant", key
        assert hits == 0
    pin = _post(keyed_server, "/v1/prefix/pin", {"prompt": SYSTEM, "ttl": 60}, "sk-a").json()
    try:
        for key in ("sk-null", ADMIN_KEY, "sk-b"):
            auth = {"Authorization": f"Bearer {key}"}
            listed = httpx.get(keyed_server.url + "/v1/prefix/pins", params={"tenant": "tenant-a"}, headers=auth)
            assert _error(listed, 403)["param"] == "tenant", key
            assert httpx.get(keyed_server.url + "/v1/prefix/pins", headers=auth).json()["data"] == [], key
            unpin = _post(keyed_server, "/v1/prefix/unpin", {"id": pin["id"], "tenant": "tenant-a"}, key)
            assert _error(unpin, 403)["param"] == "tenant", key
            claim = _post(keyed_server, "/v1/prefix/pin", {"prompt": SYSTEM, "tenant": "tenant-a"}, key)
            assert _error(claim, 403)["param"] == "tenant", key
        listed = httpx.get(keyed_server.url + "/v1/prefix/pins", headers={"Authorization": "Bearer sk-a"})
        assert [p["id"] for p in listed.json()["data"]] == [pin["id"]]
    finally:
        assert _post(keyed_server, "/v1/prefix/unpin", {"id": pin["id"]}, "sk-a").json()["deleted"] is True


def test_a_trusted_gateway_sets_the_tenant_in_the_body(gateway_server):
    response, hits = _chat_hits(gateway_server, {"tenant": "t1"})
    assert response.status_code == 200 and hits == 0
    assert _chat_hits(gateway_server, {"tenant": "t2"})[1] == 0
    assert _chat_hits(gateway_server, {})[1] == 0                      # no tenant: the anonymous namespace
    assert _chat_hits(gateway_server, {"tenant": "t1"})[1] > 0
    pin = _post(gateway_server, "/v1/prefix/pin", {"prompt": SYSTEM, "ttl": 60, "tenant": "t1"}).json()
    pins = lambda **params: httpx.get(gateway_server.url + "/v1/prefix/pins", params=params).json()["data"]
    assert [p["id"] for p in pins(tenant="t1")] == [pin["id"]]
    assert pins() == [] and pins(tenant="t2") == []
    assert _post(gateway_server, "/v1/prefix/unpin", {"id": pin["id"], "tenant": "t2"}).status_code == 404
    assert _post(gateway_server, "/v1/prefix/unpin", {"id": pin["id"], "tenant": "t1"}).json()["deleted"] is True


def test_the_trust_flag_is_a_serve_flag_and_off_by_default():
    from kvserve.cli import build_parser
    from kvserve.server.config import ServerConfig, server_config_from_args
    assert ServerConfig().trust_request_tenant is False
    args = build_parser().parse_args(["serve", "--trust-request-tenant", "--allowed-hosts", "gw.internal"])
    config = server_config_from_args(args)
    assert config.trust_request_tenant is True and config.allowed_hosts == "gw.internal"


def test_keys_file_tenants_must_be_named(tmp_path):
    """A key mapped to "" would share the anonymous namespace of --api-key and keyless requests."""
    from kvserve.server.config import ServerConfig
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k1": "", "k2": "team"}))
    with pytest.raises(ValueError, match="tenant"):
        ServerConfig(api_keys_file=str(keys)).load_api_keys()


# --------------------------------------------------------------------------------------------------
# 3. chat_template_kwargs are template variables, never tokenizer arguments
# --------------------------------------------------------------------------------------------------

def _tokenize_chat(server, kwargs=None, messages=HI, path="/v1/tokenize") -> httpx.Response:
    body = {"messages": messages} if path == "/v1/tokenize" else {"messages": messages, "max_tokens": 1}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    return _post(server, path, body)


@pytest.mark.parametrize("kwargs,key", [
    ({"padding": "max_length", "max_length": 200_000}, "padding"),
    ({"max_length": 200_000}, "max_length"),
    ({"truncation": True}, "truncation"),
    ({"tokenizer_kwargs": {"padding": "max_length", "max_length": 200_000}}, "tokenizer_kwargs"),
    ({"tokenizer_kwargs": 5}, "tokenizer_kwargs"),
    ({"return_tensors": "np"}, "return_tensors"),
    ({"tokenize": True}, "tokenize"),
    ({"return_assistant_tokens_mask": True}, "return_assistant_tokens_mask"),
    ({"chat_template": "{{ 'x' }}"}, "chat_template"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": []}, "messages"),
    ({"eos_token": "</s>"}, "eos_token"),
    ({"raise_exception": 1}, "raise_exception"),
    ({"self": 1}, "self"),
    ({"not a name": 1}, "not a name"),
])
def test_tokenizer_arguments_in_chat_template_kwargs_are_refused(open_server, kwargs, key):
    for path in ("/v1/chat/completions", "/v1/tokenize"):
        body = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": kwargs}
        if path == "/v1/tokenize":
            del body["max_tokens"]
        error = _error(_post(open_server, path, body), 400)
        assert error["param"] == f"chat_template_kwargs.{key}", (path, error)
        assert f"chat_template_kwargs.{key}" in error["message"]


def test_padding_request_is_refused_before_any_encoding(open_server):
    """The issue's 150-byte body: 20M tokens of padding. Refused from the key alone, at once."""
    started = time.monotonic()
    response = _post(open_server, "/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {
        "padding": "max_length", "max_length": 20_000_000}})
    assert _error(response, 400)["param"] == "chat_template_kwargs.padding"
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("kwargs,param,words", [
    ({f"v{i}": 1 for i in range(17)}, "chat_template_kwargs", "at most 16"),
    ({"x" * 65: 1}, "chat_template_kwargs." + "x" * 64, "64 characters"),
    ({"note": "x" * (17 << 10)}, "chat_template_kwargs.note", "bytes"),
    ({"note": [[[[[[[[["deep"]]]]]]]]]}, "chat_template_kwargs.note", "nested"),
])
def test_template_variables_are_bounded(open_server, kwargs, param, words):
    error = _error(_tokenize_chat(open_server, kwargs, path=CHAT), 400)
    assert error["param"].startswith(param) and words in error["message"], error


def test_template_variables_reach_the_template(open_server):
    plain = _tokenize_chat(open_server).json()
    noted = _tokenize_chat(open_server, {"note": "remember the milk", "enable_thinking": False}).json()
    assert noted["count"] > plain["count"]
    chat = _post(open_server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {
        "note": "remember the milk", "enable_thinking": False}})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == noted["count"]


def test_a_message_name_reaches_the_template(open_server):
    named = _tokenize_chat(open_server, messages=[{"role": "user", "content": "hi", "name": "ada"}]).json()
    assert named["count"] > _tokenize_chat(open_server).json()["count"]


# --------------------------------------------------------------------------------------------------
# 4. error bodies: our messages, never an exception's text; echoed client values are cut short
# --------------------------------------------------------------------------------------------------

def _assert_no_internals(response: httpx.Response) -> None:
    for leak in ("/root", "/tmp", ".cache", "Traceback", 'File "', "TokenizersBackend", "name_or_path"):
        assert leak not in response.text, (leak, response.text[:500])


def test_the_issue_path_leak_is_closed(open_server):
    response = _post(open_server, "/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {
        "tokenizer_kwargs": 5}})
    assert response.status_code == 400
    _assert_no_internals(response)


def test_python_exceptions_in_the_template_are_not_echoed(open_server):
    error = _error(_tokenize_chat(open_server, {"count": "many"}, path=CHAT), 400)
    assert error["param"] == "messages" and error["code"] == "invalid_messages"
    assert "interpreted" not in error["message"] and "'str'" not in error["message"]
    assert error["message"].startswith("the chat template could not render these messages")


def test_the_templates_own_raise_exception_message_is_kept_and_cut(open_server):
    error = _error(_tokenize_chat(open_server, {"refuse": "no thanks"}, path=CHAT), 400)
    assert error["message"] == "the chat template could not render these messages: refused: no thanks"
    error = _error(_tokenize_chat(open_server, {"refuse": "y" * 5000}, path=CHAT), 400)
    assert len(error["message"]) < 500 and "refused: yyy" in error["message"]


def test_a_huge_model_name_is_not_echoed_in_full(open_server):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": HI}),
                       ("/v1/tokenize", {"prompt": "hi"}), ("/v1/detokenize", {"tokens": [1]}),
                       ("/v1/prefix/pin", {"prompt": SYSTEM})):
        response = _post(open_server, path, {**body, "model": "m" * 100_000})
        error = _error(response, 404)
        assert len(response.content) < 1000 and "mmmm" in error["message"] and "100000 characters" in \
            error["message"], path


def test_huge_values_are_not_echoed_in_full(open_server):
    cases = [
        ("/v1/completions", {"prompt": "hi", "seed": int("9" * 4000)}, "seed"),
        ("/v1/completions", {"prompt": "hi", "n": int("9" * 4000)}, "n"),
        ("/v1/completions", {"prompt": "hi", "logprobs": int("9" * 4000)}, "logprobs"),
        ("/v1/prefix/unpin", {"id": int("9" * 4000)}, "id"),
        ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"k" * 50_000: 1}}, None),
    ]
    for path, body, param in cases:
        response = _post(open_server, path, body)
        assert 400 <= response.status_code < 500, response.text[:300]
        assert len(response.content) < 2000, (path, param, response.text[:300])
        if param is not None:
            assert response.json()["error"]["param"] == param
    response = httpx.post(open_server.url + "/v1/tokenize", content=b'{"prompt": "hi"}',
                          headers={"Content-Type": "text/" + "p" * 8000})
    assert response.status_code == 415 and len(response.content) < 1000
    response = httpx.get(open_server.url + "/v1/models", headers={"Host": "h" * 8000})
    assert response.status_code == 403 and len(response.content) < 1000


def test_unexpected_engine_errors_are_not_sent_to_the_client(tiny_model, monkeypatch):
    """Only RequestRejected carries a message written for clients; any other error from
    add_request is a 500 whose text stays in the log. (An engine of this process, to break it.)"""
    from kvserve.engine.engine import Engine
    engine = Engine.from_options(model=tiny_model, max_model_len=1024, kv_cache_memory=8 << 20)
    server = LoopbackServer(engine)

    def broken(*args, **kwargs):
        raise ValueError("cannot open /root/.cache/kvserve/secret.bin")
    monkeypatch.setattr(engine, "add_request", broken)
    try:
        response = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert _error(response, 500)["message"] == "internal server error"
        _assert_no_internals(response)
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------
# 10. fields we recognise but do not support are a 400 naming them; inert values pass
# --------------------------------------------------------------------------------------------------

UNSUPPORTED = [
    (CHAT, "guided_whitespace_pattern", " "),
    (CHAT, "guided_decoding_backend", "outlines"),
    (CHAT, "logit_bias", {"5": 1.0}),
    (COMPLETIONS, "logit_bias", {"5": 1.0}),
    (CHAT, "logits_processors", ["x"]),
    (CHAT, "allowed_token_ids", [1, 2]),
    (CHAT, "bad_words", ["x"]),
    (CHAT, "use_beam_search", True),
    (COMPLETIONS, "prompt_logprobs", 1),
    (COMPLETIONS, "truncate_prompt_tokens", 10),
    (CHAT, "spaces_between_special_tokens", False),
    (CHAT, "return_tokens_as_token_ids", True),
    (CHAT, "vllm_xargs", {"a": 1}),
    (COMPLETIONS, "suffix", "x"),
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "function_call", {"name": "f"}),
    (CHAT, "documents", [{"title": "t", "text": "x"}]),
    (CHAT, "chat_template", "{{ 'x' }}"),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "web_search_options", {}),
    (CHAT, "reasoning_effort", "high"),
    (CHAT, "verbosity", "low"),
    (CHAT, "echo", True),
    (CHAT, "add_special_tokens", True),
    (CHAT, "include_reasoning", False),
]


@pytest.mark.parametrize("path,field,value", UNSUPPORTED, ids=[f"{'chat' if p == CHAT else 'cmpl'}-{f}-{i}"
                                                               for i, (p, f, _) in enumerate(UNSUPPORTED)])
def test_recognised_but_unsupported_fields_are_refused(open_server, path, field, value):
    body = {"messages": HI} if path == CHAT else {"prompt": "hi"}
    error = _error(_post(open_server, path, {**body, "max_tokens": 1, field: value}), 400)
    assert error["param"] == field and error["code"] == "unsupported"
    assert field in error["message"]


@pytest.mark.parametrize("field,value", [("function_call", {"name": "f", "arguments": "{}"}),
                                         ("reasoning_content", "let me think"), ("audio", {"id": "a"})])
def test_unsupported_message_fields_are_refused(open_server, field, value):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", field: value},
                {"role": "user", "content": "and?"}]
    for path in (CHAT, "/v1/tokenize"):
        error = _error(_post(open_server, path, {"messages": messages}), 400)
        assert error["param"] == f"messages.1.{field}" and error["code"] == "unsupported", path


@pytest.mark.parametrize("path,field,value", [
    ("/v1/tokenize", "tools", [{"type": "function"}]),
    ("/v1/tokenize", "return_token_strs", True),
    ("/v1/tokenize", "continue_final_message", True),
    ("/v1/prefix/pin", "chat_template_kwargs", {"enable_thinking": False}),
    ("/v1/prefix/pin", "tools", [{"type": "function"}]),
])
def test_unsupported_fields_of_the_other_endpoints(open_server, path, field, value):
    body = {"messages": HI} if path == "/v1/tokenize" else {"prompt": SYSTEM}
    error = _error(_post(open_server, path, {**body, field: value}), 400)
    assert error["param"] == field and error["code"] == "unsupported"


def test_inert_values_and_fields_that_cannot_change_the_output_pass(open_server):
    reference = _post(open_server, CHAT, {"messages": HI, "max_tokens": 4, "temperature": 0}).json()
    inert = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "functions": [],
             "function_call": "auto", "logit_bias": {}, "modalities": ["text"], "audio": None, "echo": False,
             "guided_json": None, "use_beam_search": False, "spaces_between_special_tokens": True,
             "parallel_tool_calls": True, "prediction": {"type": "content", "content": "hello"},
             "user": "u-1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
             "safety_identifier": "s", "prompt_cache_key": "k", "some_future_field": 1}
    response = _post(open_server, CHAT, {"messages": [{"role": "user", "content": "hi", "refusal": None}],
                                         "max_tokens": 4, "temperature": 0, **inert})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    response = _post(open_server, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "suffix": None, "logit_bias": {},
                                                "response_format": {"type": "text"}, "user": "u"})
    assert response.status_code == 200, response.text


def test_no_model_both_declares_and_refuses_a_field():
    from kvserve.server.protocol import REQUEST_MODELS, ChatMessage
    for model in (*REQUEST_MODELS, ChatMessage):
        assert not set(model.UNSUPPORTED) & set(model.model_fields), model.__name__


# --------------------------------------------------------------------------------------------------
# work a request makes for everyone stays bounded
# --------------------------------------------------------------------------------------------------

def test_long_stop_strings_are_refused(open_server):
    """Every token of the request searches the text as far back as its longest stop string, on the
    engine thread that serves everyone (and a stream holds back that much text)."""
    error = _error(_post(open_server, COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "stop": ["x" * 1025]}), 400)
    assert error["param"] == "stop" and "1024 characters" in error["message"]
    assert _post(open_server, COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "stop": ["x" * 1024]}).status_code == 200

"""The FastAPI app of `kvserve serve` (one per front end): routes, API-key auth, lifespan.

Request bodies are read here, not by FastAPI, so every failure has its own message: a body not
labelled `Content-Type: application/json` is refused (415), an oversized body is refused from its
Content-Length before a byte is read (413), then come invalid UTF-8, malformed JSON, a non-object
body, and schema errors (400, naming the field). The OpenAPI document still describes every body
(the schemas are added to it by `_openapi`), so schema-driven clients and fuzzers see the real API.

Web pages: a browser lets any page send text/plain, form and multipart POSTs to any origin without
asking (no CORS preflight), so only JSON-labelled bodies are read, and no CORS headers are ever
sent. A page that rebinds its own DNS name to 127.0.0.1 is same-origin with a local server and
needs neither; its requests still carry its name in Host, which `_HostCheck` refuses (403) unless
--allowed-hosts names it (on a loopback --host, only loopback names are served by default).

/health and /metrics need no API key (probes and Prometheus scrape them); /v1/* do when keys are
configured. GET /v1/usage (per-tenant usage) and /v1/admin/config (engine settings changed at run
time: server/admin_config.py) need the admin key (--admin-api-key), which opens nothing else; so
does /dashboard/events, the stream of the live KV map (server/dashboard.py), whose page /dashboard
is public static HTML that asks for the key.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import os
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import Depends, FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

import kvserve
from kvserve.engine.client import EngineClient, ServedModel
from kvserve.obs.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.sched.slo import SLOTargets
from kvserve.server.admin_config import install_admin_config
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, echo, format_validation_errors, install_error_handlers
from kvserve.server.protocol import (REQUEST_MODELS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     PrefixPinRequest, PrefixUnpinRequest, TokenizeRequest)
from kvserve.server.serving_base import ServingContext, SSEStream
from kvserve.server.serving_chat import OpenAIServingChat
from kvserve.server.serving_completions import OpenAIServingCompletion
from kvserve.server.serving_pins import OpenAIServingPins
from kvserve.server.dashboard import install_dashboard
from kvserve.server.serving_tokenize import OpenAIServingTokenization
from kvserve.server.usage import usage_summary

logger = logging.getLogger("kvserve.server")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _SSEResponse(StreamingResponse):
    """Server-sent events that abort their engine requests however the response ends: a client gone
    before the first chunk never starts the chunk generator, so its own cleanup would not run."""

    def __init__(self, result: SSEStream) -> None:
        super().__init__(result.chunks, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._engine_stream = result.engine_stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._engine_stream.finished:
                self._engine_stream.abort()


def default_model_name(model_option: Optional[str], source_path: str) -> str:
    """The name clients send: --model as given for hub-style names, else the file/folder name
    (without .gguf and a quantization tag such as .Q4_1)."""
    if model_option and not os.path.exists(model_option):
        return model_option
    name = os.path.basename(os.path.normpath(model_option or source_path))
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    return re.sub(r"[.-](q\d\w*|f16|f32|bf16|iq\d\w*)$", "", name, flags=re.IGNORECASE) or name


def _body_schema_ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def check_json_content_type(header: Optional[str]) -> None:
    """415 unless the body is labelled application/json (any parameters; charset, if given, UTF-8).
    Not application/*+json: browsers' reporting machinery posts application/reports+json, and no
    client of an OpenAI API needs it."""
    if header is None:
        raise APIError(415, "Content-Type is missing: send `Content-Type: application/json` "
                            "(curl: -H 'Content-Type: application/json')", code="unsupported_media_type")
    media_type, *parameters = header.split(";")
    if media_type.strip().lower() != "application/json":
        raise APIError(415, f"Content-Type {echo(header)} is not accepted: request bodies are JSON, sent with "
                            f"`Content-Type: application/json`", code="unsupported_media_type")
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise APIError(415, f"Content-Type {echo(header)}: request bodies are read as UTF-8 "
                                f"(application/json; charset=utf-8)", code="unsupported_media_type")


async def read_body(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    check_json_content_type(request.headers.get("content-type"))
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise APIError(400, "Content-Length is not an integer") from None
        if declared > max_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes",
                           code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
    if not body:
        raise APIError(400, "request body is empty: send a JSON object", code="invalid_json")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 (bad byte at offset {exc.start})",
                       code="invalid_encoding") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       code="invalid_json") from None
    except (ValueError, RecursionError) as exc:   # e.g. integers longer than Python's digit limit
        raise APIError(400, f"malformed JSON: {type(exc).__name__}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)",
                       code="invalid_encoding") from None
    except (ValueError, RecursionError):
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise format_validation_errors(exc.errors(include_url=False)) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None


def build_app(async_engine: EngineClient, config: Optional[ServerConfig] = None,
              model_names: Optional[list[str]] = None, metrics_dir: Optional[str] = None) -> FastAPI:
    """The app around an (unstarted) engine client; its lifespan starts and stops it. metrics_dir:
    where the front ends of one server sum their request metrics (several front ends only)."""
    config = config or ServerConfig()
    config.validate()
    served = async_engine.served
    if model_names is None:
        model_names = (list(config.served_model_name) if config.served_model_name
                       else [default_model_name(served.model, served.source_path)])
    api_keys = config.load_api_keys()
    admin_key = config.load_admin_key(api_keys)
    # Metrics read the snapshot the engine side republishes (made from Engine.make_stats()).
    metrics = ServerMetrics(lambda: async_engine.snapshot, model_names[0], slo=_slo_targets(served),
                            multiprocess_dir=metrics_dir, vllm_aliases=config.vllm_metric_aliases)
    async_engine.on_request_finished = metrics.observe_finished
    serving = ServingContext(async_engine, config, model_names)
    completions_api = OpenAIServingCompletion(serving)
    chat_api = OpenAIServingChat(serving)
    tokenization_api = OpenAIServingTokenization(serving)
    pins_api = OpenAIServingPins(serving)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        logger.info("serving %s (max_model_len %d) with %d API keys", model_names[0], serving.max_model_len,
                    len(api_keys))
        try:
            yield
        finally:
            # uvicorn has already waited (shutdown_timeout) for open responses; anything left gets an error.
            await async_engine.shutdown(drain_timeout=min(5.0, config.shutdown_timeout))
            serving.close()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the kvserve inference engine.")
    app.state.async_engine = async_engine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.config = config
    install_error_handlers(app, on_error=metrics.count_error)

    async def authenticate(request: Request) -> Optional[str]:
        """Returns the tenant of the API key (None without keys or for --api-key)."""
        if not api_keys:
            return None
        token = _bearer_token(request)
        if not token:
            raise APIError(401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
        matched = _matching_key(token, api_keys)
        if matched is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return api_keys[matched]

    async def authenticate_admin(request: Request) -> None:
        """The operator's endpoints: the admin key opens them, a tenant's key is refused (403)."""
        if admin_key is None:
            raise APIError(403, f"{request.url.path} is for the operator and this server has no admin key: start it "
                                "with --admin-api-key (or $KVSERVE_ADMIN_API_KEY)", code="admin_key_not_set")
        token = _bearer_token(request)
        if not token:
            raise APIError(401, f"missing admin API key: {request.url.path} needs `Authorization: Bearer "
                                "<admin key>` (the server's --admin-api-key)", code="invalid_api_key")
        if _matching_key(token, [admin_key]) is not None:
            return
        if _matching_key(token, api_keys) is not None:
            raise APIError(403, f"{request.url.path} needs the admin API key (--admin-api-key); a tenant's API key "
                                "does not open it", code="admin_key_required")
        raise APIError(401, "invalid admin API key", code="invalid_api_key")

    @app.get("/health", summary="200 while the engine thread runs")
    async def health() -> JSONResponse:
        if async_engine.is_running:
            return JSONResponse({"status": "ok"})
        raise APIError(503, "the engine is not running", code="engine_not_running")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvserve.__version__}

    @app.get("/metrics", summary="Prometheus metrics (text format)")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(_tenant: Optional[str] = Depends(authenticate)) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": serving.created, "owned_by": "kvserve",
             "root": model_names[0], "max_model_len": serving.max_model_len} for name in model_names]}

    def _respond(result: Any) -> Any:
        if isinstance(result, SSEStream):
            return _SSEResponse(result)
        return JSONResponse(result)

    @app.post("/v1/completions", openapi_extra=_body_schema_ref(CompletionRequest))
    async def completions(request: Request, tenant: Optional[str] = Depends(authenticate)) -> Any:
        body = await read_body(request, CompletionRequest, config.max_request_bytes)
        return _respond(await completions_api.create_completion(body, request, tenant))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema_ref(ChatCompletionRequest))
    async def chat_completions(request: Request, tenant: Optional[str] = Depends(authenticate)) -> Any:
        body = await read_body(request, ChatCompletionRequest, config.max_request_bytes)
        return _respond(await chat_api.create_chat_completion(body, request, tenant))

    @app.post("/v1/tokenize", openapi_extra=_body_schema_ref(TokenizeRequest))
    async def tokenize(request: Request, _tenant: Optional[str] = Depends(authenticate)) -> Any:
        return await tokenization_api.tokenize(await read_body(request, TokenizeRequest, config.max_request_bytes))

    @app.post("/v1/detokenize", openapi_extra=_body_schema_ref(DetokenizeRequest))
    async def detokenize(request: Request, _tenant: Optional[str] = Depends(authenticate)) -> Any:
        return await tokenization_api.detokenize(await read_body(request, DetokenizeRequest,
                                                                 config.max_request_bytes))

    @app.post("/v1/prefix/pin", openapi_extra=_body_schema_ref(PrefixPinRequest),
              summary="pin a prefix in the prefix cache for a retention time (docs/prefix_caching.md)")
    async def pin_prefix(request: Request, tenant: Optional[str] = Depends(authenticate)) -> Any:
        return await pins_api.pin_prefix(await read_body(request, PrefixPinRequest, config.max_request_bytes), tenant)

    @app.post("/v1/prefix/unpin", openapi_extra=_body_schema_ref(PrefixUnpinRequest))
    async def unpin_prefix(request: Request, tenant: Optional[str] = Depends(authenticate)) -> Any:
        return await pins_api.unpin_prefix(await read_body(request, PrefixUnpinRequest, config.max_request_bytes),
                                           tenant)

    @app.get("/v1/prefix/pins", summary="your tenant's active pins")
    async def list_pins(tenant: Optional[str] = Depends(authenticate),
                        requested: Optional[str] = Query(None, alias="tenant", max_length=256,
                                                         description="with --trust-request-tenant")) -> Any:
        return await pins_api.list_pins(tenant, requested)

    @app.get("/v1/usage", summary="per-tenant requests, tokens, KV blocks and fair-share counters (admin key)")
    async def usage(_admin: None = Depends(authenticate_admin)) -> dict[str, Any]:
        return usage_summary(async_engine.snapshot)

    install_dashboard(app, async_engine, authenticate_admin, model_names[0])   # /dashboard: the live KV map

    install_admin_config(app, async_engine, authenticate_admin,
                         lambda request, model: read_body(request, model, config.max_request_bytes))

    # vLLM serves these at the root too; same handlers, kept out of the schema to avoid duplicates.
    app.add_api_route("/tokenize", tokenize, methods=["POST"], include_in_schema=False)
    app.add_api_route("/detokenize", detokenize, methods=["POST"], include_in_schema=False)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in REQUEST_MODELS:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    allowed_hosts = config.allowed_host_names()
    if allowed_hosts is not None:
        app.add_middleware(_HostCheck, allowed=allowed_hosts, on_error=metrics.count_error)
    return app


def _bearer_token(request: Request) -> str:
    """The key of `Authorization: Bearer KEY` ("" without one)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _matching_key(token: str, keys: Any) -> Optional[str]:
    """The key of `keys` equal to `token`, compared against every one so that the time taken
    does not reveal which one matched (or how much of one did)."""
    matched = None
    for key in keys:
        if hmac.compare_digest(key.encode(), token.encode()):
            matched = key
    return matched


class _HostCheck:
    """Refuses a request whose Host header names a host this server is not (403), before any route
    runs: the DNS-rebinding defence (see the module docstring)."""

    def __init__(self, app: Any, allowed: frozenset[str], on_error: Any) -> None:
        self.app = app
        self.allowed = allowed
        self.on_error = on_error

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host")
            # No Host at all is not a browser (every browser sends one): nothing to defend against.
            if host is not None and _host_name(host.decode("latin-1")) not in self.allowed:
                self.on_error(403)
                error = APIError(403, f"Host {echo(host.decode('latin-1'))} is not served here: start the server "
                                      "with --allowed-hosts naming it", code="host_not_allowed")
                await JSONResponse(error.body(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """'Example.COM:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _slo_targets(served: ServedModel) -> Optional[SLOTargets]:
    """The targets the scheduler keeps (None without any): metrics judge requests by the same ones."""
    if served.slo_ttft_s is None and served.slo_tpot_s is None:
        return None
    return SLOTargets(ttft_s=served.slo_ttft_s, tpot_s=served.slo_tpot_s)

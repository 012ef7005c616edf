"""What every endpoint family shares: `ServingContext` (the engine, options, model facts, the one
tokenizer thread) and `OpenAIServing`, the base of the families (serving_completions.py,
serving_chat.py, serving_tokenize.py, serving_pins.py).

The base owns the server-side rules the engine cannot know (served model names, tenants, the n and
logprobs limits, context-length checks with a helpful message), the request -> SamplingParams
conversion, tokenization and chat templates off the event loop, submitting to the AsyncEngine and
collecting its outputs, the SSE helpers and the mapping of engine errors to HTTP errors.

Streaming invariants (the families' streams keep them with `ChoiceState` and `text_delta`):
- engine outputs are cumulative; each choice remembers how much text / how many tokens it sent;
- with stop strings, the last len(longest stop) - 1 characters are held back until the request
  finishes, because a stop string completed by a later token cuts text that would otherwise
  already have been sent;
- a client that goes away (stream cancelled, or a disconnect seen while a non-streamed request
  runs) aborts its engine requests at once, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi import Request
from jinja2.exceptions import TemplateError

from kvserve.engine.client import EngineClient, EngineDeadError, EngineShutdownError, EngineStepError, RequestStream
from kvserve.engine.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplateError, read_chat_template
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.sched.scheduler import RequestForbidden, RequestRejected
from kvserve.server.structured_fields import structured_output_of
from kvserve.server.tools import template_tool_calls
from kvserve.sched.slo import RequestOverloaded
from kvserve.model.loader.generation_config import sampling_defaults
from kvserve.obs.tracing import RequestTracer
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, bad_request, echo, error_body, from_value_error
from kvserve.server.protocol import ChatMessage
from kvserve.server.reasoning import ReasoningParser

logger = logging.getLogger("kvserve.server")

_SEED_LIMIT = 2 ** 63 - 1024   # engine seeds per sample are seed + index; stay inside int64
_MAX_STOP_STRINGS = 64
_MAX_STOP_CHARS = 1024
_MAX_STOP_TOKEN_IDS = 1024

# chat_template_kwargs: a few small template variables (enable_thinking and the like), not data.
_MAX_TEMPLATE_VARIABLES = 16
_MAX_TEMPLATE_VARIABLE_BYTES = 16 << 10    # all values together, as JSON
_MAX_TEMPLATE_VALUE_DEPTH = 8
_TEMPLATE_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# apply_chat_template arguments a chat request sets through fields of its own.
_REQUEST_FIELDS = frozenset({"add_generation_prompt", "continue_final_message"})


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class SSEStream:
    """A streamed answer: the SSE text chunks, and the engine stream to abort if the response ends
    early for any reason (even before the first chunk was asked for)."""
    chunks: AsyncIterator[str]
    engine_stream: RequestStream


@dataclass
class ChoiceState:
    """What one streamed choice has sent so far."""
    text_sent: int = 0
    tokens_sent: int = 0
    text_offset: int = 0
    finished: bool = False
    started: bool = False


@dataclass
class UsageCounter:
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: dict[tuple[str, int], int] = field(default_factory=dict)
    reasoning_tokens: Optional[dict[tuple[str, int], int]] = None    # with a reasoning parser

    def update(self, output: RequestOutput) -> None:
        self.prompt_tokens[output.request_id] = len(output.prompt_token_ids)
        if output.num_cached_tokens is not None:
            self.cached_tokens[output.request_id] = output.num_cached_tokens
        for sample in output.outputs:
            self.completion_tokens[(output.request_id, sample.index)] = len(sample.token_ids)

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.completion_tokens.values())
        # As OpenAI reports them: prompt tokens served from the cache (here the prefix cache and
        # the KV tiers), within prompt_tokens.
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(self.reasoning_tokens.values())}
        return usage


class ServingContext:
    """Shared by every endpoint family: built once per app (app.state.serving)."""

    def __init__(self, async_engine: EngineClient, config: ServerConfig, model_names: list[str]) -> None:
        served = async_engine.served
        self.async_engine = async_engine
        self.config = config
        self.model_names = model_names
        # These never change after the engine is built, so the HTTP side reads them once.
        self.tokenizer = async_engine.tokenizer
        # The renderer LLM.chat uses too; --chat-template replaces the tokenizer's template.
        self.chat_template = ChatTemplate(self.tokenizer, read_chat_template(config.chat_template))
        self.reasoning = ReasoningParser(config.reasoning_parser) if config.reasoning_parser else None
        # The model's recommended sampling, for fields a request leaves unset (--generation-config auto).
        self.sampling_defaults = sampling_defaults(served.source_path) if config.generation_config == "auto" else {}
        if self.sampling_defaults:
            logger.info("sampling defaults from the model's generation_config.json: %s (--generation-config none "
                        "turns them off)", self.sampling_defaults)
        self.max_model_len = served.max_model_len
        self.vocab_size = served.vocab_size
        self.max_num_seqs = served.max_num_seqs
        self.slo_ttft = served.slo_ttft_s
        self.created = int(time.time())
        # --otlp-traces-endpoint: a trace per request (kvserve/obs/tracing.py); None: off.
        self.tracer = (RequestTracer(config.otlp_traces_endpoint, model_names[0])
                       if config.otlp_traces_endpoint else None)
        # One worker: tokenizers are used by one HTTP-side thread at a time; long prompts and
        # chat templates never stall the event loop.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenize")
        self.token_text_cache: dict[int, str] = {}

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    async def run_in_tokenizer(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn)

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        if self.tracer is not None:
            self.tracer.shutdown()          # the last traces go out


class OpenAIServing:
    """The base of the endpoint families: the checks, conversions and engine calls they share."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.async_engine = context.async_engine
        self.config = context.config
        self.model_names = context.model_names
        self.tokenizer = context.tokenizer
        self.chat_template = context.chat_template
        self.max_model_len = context.max_model_len
        self.vocab_size = context.vocab_size
        self.max_num_seqs = context.max_num_seqs

    @property
    def slo_ttft(self) -> Optional[float]:
        """The server's TTFT target now (the admin config API may change it): the engine's latest
        snapshot's, else the one it started with."""
        snapshot = self.async_engine.snapshot
        return snapshot.slo_ttft_target_s if snapshot.slo_max_running is not None else self.context.slo_ttft

    # --- shared checks ---------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: Optional[str]) -> str:
        if name is None or name in self.model_names:
            return self.model_name
        raise APIError(404, f"the model {echo(name)} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.model_names)}",
                       param="model", code="model_not_found")

    def resolve_tenant(self, key_tenant: Optional[str], requested: Optional[str]) -> Optional[str]:
        """The tenant a request runs as: its API key's. A tenant named in the request (body or query)
        must be that one, unless the server trusts a gateway in front of it to set tenants
        (--trust-request-tenant); even then a key mapped to a tenant keeps it. Anything else is a 403,
        not ignored, so a misconfigured gateway notices at once instead of mixing its users' caches."""
        if requested is None or requested == key_tenant:
            return key_tenant
        if self.config.trust_request_tenant and key_tenant is None:
            return requested
        why = ("this API key belongs to another tenant" if key_tenant is not None else
               "tenants come from API keys (--api-keys-file); a request may name one only when the server "
               "runs with --trust-request-tenant behind a gateway that authenticates users")
        raise APIError(403, f"tenant {echo(requested)} is not allowed: {why}", param="tenant",
                       code="tenant_not_allowed")

    def _check_common(self, req: Any, num_top: Optional[int], top_field: str) -> None:
        limit_n = min(self.config.max_n, self.max_num_seqs)
        if isinstance(req.n, int) and req.n > limit_n:
            raise bad_request(f"n must be at most {limit_n} on this server, got {echo(req.n)}", "n", "n_too_large")
        if num_top is not None and num_top > self.config.max_logprobs:
            raise bad_request(f"{top_field} must be at most {self.config.max_logprobs}, got {echo(num_top)}",
                              top_field)
        if req.seed is not None and not -_SEED_LIMIT <= req.seed <= _SEED_LIMIT:
            raise bad_request(f"seed must lie in [-{_SEED_LIMIT}, {_SEED_LIMIT}], got {echo(req.seed)}", "seed")
        # Stop strings are matched on the engine thread after every token, for every request in
        # the batch: a request with thousands of them would slow everyone down.
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > _MAX_STOP_STRINGS:
            raise bad_request(f"stop may hold at most {_MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
        # Each token's search window (and the text a stream holds back) is as long as the longest one.
        if any(len(stop) > _MAX_STOP_CHARS for stop in stops):
            raise bad_request(f"stop strings may be at most {_MAX_STOP_CHARS} characters long", "stop")
        if req.stop_token_ids and len(req.stop_token_ids) > _MAX_STOP_TOKEN_IDS:
            raise bad_request(f"stop_token_ids may hold at most {_MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
        if req.stop_token_ids and any(not 0 <= t < self.vocab_size for t in req.stop_token_ids):
            raise bad_request(f"stop_token_ids must lie in [0, {self.vocab_size})", "stop_token_ids")

    def _check_token_ids(self, token_ids: list[int], what: str, param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise bad_request(f"{what} must lie in [0, {self.vocab_size})", param, "invalid_token_id")

    def _sampling_params(self, req: Any, max_tokens: Optional[int], logprobs: Optional[int],
                         prompt_logprobs: Optional[int]) -> SamplingParams:
        model = self.context.sampling_defaults

        def given(name: str, default: Any) -> Any:
            value = getattr(req, name)
            return value if value is not None else model.get(name, default)
        try:
            return SamplingParams(
                n=req.n, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", 0),
                min_p=given("min_p", 0.0), seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=given("repetition_penalty", 1.0),
                max_tokens=max_tokens if max_tokens is not None else model.get("max_tokens"), min_tokens=req.min_tokens, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, kv_press=req.kv_press,
                kv_keep_ratio=req.kv_keep_ratio, kv_keep_tokens=req.kv_keep_tokens,
                kv_press_mode=req.kv_press_mode, qos_class=req.qos_class,
                structured_output=structured_output_of(req))
        except ValueError as exc:
            raise from_value_error(exc) from None

    def _check_length(self, num_prompt_tokens: int, max_tokens: Optional[int], param: str) -> None:
        if num_prompt_tokens < 1:
            raise bad_request(f"{param} is empty: it tokenizes to no tokens", param, "empty_prompt")
        wanted = max_tokens if max_tokens is not None else 1
        if num_prompt_tokens + wanted > self.max_model_len:
            if max_tokens is None or num_prompt_tokens >= self.max_model_len:
                detail = f"your prompt has {num_prompt_tokens} tokens"
            else:
                detail = (f"you asked for {num_prompt_tokens + max_tokens} tokens "
                          f"({num_prompt_tokens} in the prompt, {max_tokens} to generate)")
            raise bad_request(f"this model's maximum context length is {self.max_model_len} tokens, but "
                              f"{detail}; shorten the prompt or lower max_tokens", param,
                              "context_length_exceeded")

    def _check_not_rejected(self, output: RequestOutput) -> None:
        """Raises RequestOverloaded for a request the scheduler shed (it missed its TTFT deadline)."""
        if output.finished and any(sample.finish_reason == "rejected" for sample in output.outputs):
            # Shed for the server's target, or (request classes, no server target) for its class's.
            target = f"the {self.slo_ttft:g} s TTFT target" if self.slo_ttft is not None else "its class's TTFT target"
            raise RequestOverloaded(f"server overloaded: the request could not start within {target}; retry later")

    # --- tokenizer and chat template (off the event loop) -----------------------------------------
    async def _run_in_tokenizer(self, fn: Callable[[], Any]) -> Any:
        return await self.context.run_in_tokenizer(fn)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise bad_request(f"this model has no tokenizer, so {what} is not available; send token ids")
        return self.tokenizer

    def token_text(self, token_id: int) -> str:
        cache = self.context.token_text_cache
        text = cache.get(token_id)
        if text is None:
            tokenizer = self.tokenizer
            text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else ""
            if len(cache) < 200_000:
                cache[token_id] = text
        return text

    async def tokenize_text(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        tokenizer = self._require_tokenizer("a text prompt")

        def encode() -> list[int]:
            return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        try:
            return await self._run_in_tokenizer(encode)
        except Exception as exc:
            raise bad_request(f"{param} could not be tokenized ({type(exc).__name__})", param) from None

    async def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool,
                                  continue_final_message: bool,
                                  chat_template_kwargs: Optional[dict[str, Any]],
                                  tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """The conversation's prompt token ids, rendered by the ChatTemplate LLM.chat uses; the
        argument checks answer here (400s), the render runs on the tokenizer thread."""
        self._require_tokenizer("chat")
        conversation = [_template_message(m) for m in messages]
        renderer = self.chat_template
        try:
            renderer.check(conversation, add_generation_prompt, continue_final_message)
        except NoChatTemplateError:
            raise bad_request("this model has no chat template: use /v1/completions", "messages") from None
        except ChatTemplateError as exc:
            raise bad_request(str(exc), exc.param) from None
        variables = self._template_variables(chat_template_kwargs)

        def render_and_encode() -> list[int]:
            return renderer.encode(conversation, add_generation_prompt, continue_final_message, tools=tools,
                                   variables=variables)
        try:
            return await self._run_in_tokenizer(render_and_encode)
        except Exception as exc:
            raise _template_failure(exc) from None

    def _template_variables(self, kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
        """chat_template_kwargs checked as template variables: a few, small, and under names that are
        neither apply_chat_template's own arguments (padding, max_length, tokenizer_kwargs, ... would
        reach the tokenizer) nor names the template context binds itself."""
        kwargs = kwargs or {}
        if len(kwargs) > _MAX_TEMPLATE_VARIABLES:
            raise bad_request(f"chat_template_kwargs may hold at most {_MAX_TEMPLATE_VARIABLES} variables, "
                              f"got {len(kwargs)}", "chat_template_kwargs")
        total = 0
        reserved = self.chat_template.reserved_names
        for name, value in kwargs.items():
            param = f"chat_template_kwargs.{name[:64]}"
            if not _TEMPLATE_VARIABLE_NAME.fullmatch(name):
                raise bad_request(f"{param}: a template variable name is letters, digits and _ (not first), "
                                  f"at most 64 characters; got {echo(name)}", param)
            if name in reserved:
                raise bad_request(f"{param}: {name} is an argument of the tokenizer's chat-template call or a name "
                                  f"the template binds itself, not a template variable" +
                                  (f" (use the request field {name})" if name in _REQUEST_FIELDS else ""), param)
            if _depth(value, _MAX_TEMPLATE_VALUE_DEPTH + 1) > _MAX_TEMPLATE_VALUE_DEPTH:
                raise bad_request(f"{param}: the value is nested more than {_MAX_TEMPLATE_VALUE_DEPTH} levels deep",
                                  param)
            total += len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
            if total > _MAX_TEMPLATE_VARIABLE_BYTES:
                raise bad_request(f"{param}: the template variables come to more than "
                                  f"{_MAX_TEMPLATE_VARIABLE_BYTES} bytes of JSON", param)
        return dict(kwargs)

    # --- the engine ------------------------------------------------------------------------------
    async def _submit(self, request_id: str, prompt_ids: list[list[int]], params: SamplingParams, req: Any,
                      tenant: Optional[str], arrival_time: float, raw: Optional[Request] = None) -> RequestStream:
        """Queues the prompts under `tenant` (already resolved by resolve_tenant); `arrival_time` is
        when the request reached the server (time.monotonic()). With tracing on, the stream carries
        the request's trace (its parent from `raw`'s traceparent), ended with the stream."""
        stream = self.async_engine.open_stream()
        tracer = self.context.tracer
        if tracer is not None:
            stream.trace = tracer.start(raw.headers if raw is not None else {}, request_id, arrival_time,
                                        {"gen_ai.request.max_tokens": params.max_tokens or 0,
                                         "gen_ai.request.temperature": params.temperature,
                                         "gen_ai.request.top_p": params.top_p, "gen_ai.request.n": params.n,
                                         "gen_ai.request.stream": bool(getattr(req, "stream", False))})
        traced = stream.trace is not None and stream.trace.is_recording
        try:
            await self._add_prompts(stream, request_id, prompt_ids, params, req, tenant, arrival_time, traced)
        except APIError as exc:
            if stream.trace is not None:
                stream.trace.fail(exc.status_code, str(exc))
            raise
        except BaseException as exc:
            if stream.trace is not None:
                stream.trace.fail(500, type(exc).__name__)
            raise
        return stream

    async def _add_prompts(self, stream: RequestStream, request_id: str, prompt_ids: list[list[int]],
                           params: SamplingParams, req: Any, tenant: Optional[str], arrival_time: float,
                           traced: bool) -> None:
        """Adds each prompt to the engine on `stream`; an engine refusal becomes its HTTP error,
        and what was added is aborted."""
        engine = self.async_engine
        # Prefix-cache options ride in the prompt dict (as vLLM's cache_salt does), so AsyncEngine
        # passes them through unchanged; the tenant picks the cache namespace.
        cache_options = {key: value for key, value in (("tenant", tenant), ("cache_salt", req.cache_salt),
                                                       ("pin_ttl", req.pin_ttl),
                                                       ("pin_prefix_tokens", req.pin_prefix_tokens))
                         if value is not None}
        try:
            for index, ids in enumerate(prompt_ids):
                await engine.add_request(f"{request_id}-{index}", {"prompt_token_ids": ids, **cache_options}, params,
                                         stream=stream, tenant=tenant, priority=req.priority,
                                         arrival_time=arrival_time, trace=traced)
        except EngineShutdownError as exc:
            stream.abort()
            raise APIError(503, str(exc), code="server_shutting_down") from None
        except EngineDeadError as exc:
            stream.abort()
            raise APIError(503, str(exc), type="server_error", code="engine_dead") from None
        except RequestOverloaded as exc:
            stream.abort()
            raise APIError(503, str(exc), code="overloaded") from None
        except RequestForbidden as exc:
            stream.abort()
            raise APIError(403, str(exc), param="qos_class", code="forbidden") from None
        except RequestRejected as exc:   # the prompt can never run; the message is written for clients
            stream.abort()
            raise from_value_error(exc, "prompt") from None
        except BaseException:
            stream.abort()
            raise

    async def _collect(self, stream: RequestStream, raw: Request) -> dict[str, RequestOutput]:
        """All final outputs, aborting everything if the client disconnects meanwhile."""
        finals: dict[str, RequestOutput] = {}

        async def consume() -> None:
            async for output in stream:
                self._check_not_rejected(output)
                if output.finished:
                    finals[output.request_id] = output

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer not in done:
                # Nobody will read this answer; what matters is that the blocks come back now.
                raise APIError(499, "client closed the connection", code="client_disconnected")
            consumer.result()
        except (EngineStepError, EngineShutdownError) as exc:
            status = 503 if isinstance(exc, EngineShutdownError) else 500
            raise APIError(status, str(exc), type="server_error") from None
        except EngineDeadError as exc:
            raise APIError(500, str(exc), type="server_error", code="engine_dead") from None
        except RequestOverloaded as exc:
            raise APIError(503, str(exc), code="overloaded") from None
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
            if not stream.finished:
                stream.abort()
            if stream.trace is not None:
                stream.trace.end(stream.final_outputs)
        return finals

    async def _call_engine(self, call: Awaitable[Any]) -> Any:
        return await call_engine(call)


async def call_engine(call: Awaitable[Any]) -> Any:
    """Awaits an engine-side call (a pin, a pin list, the admin config); a stopping or dead engine
    is a 503."""
    try:
        return await call
    except EngineShutdownError as exc:
        raise APIError(503, str(exc), code="server_shutting_down") from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type="server_error", code="engine_dead") from None


def _template_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": _message_text(message)}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = template_tool_calls(message)
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _depth(value: Any, limit: int) -> int:
    """How deeply lists and objects nest in a JSON value (a scalar is 0), counted up to `limit`."""
    if limit <= 0 or not isinstance(value, (list, dict)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(child, limit - 1) for child in children), default=0)


def _template_failure(exc: Exception) -> APIError:
    """The 400 for a template that failed on these messages. Only what the template raised itself
    (raise_exception, e.g. "roles must alternate") is its author's text for the client; jinja2
    raises only subclasses of TemplateError, so an exact TemplateError is that. Anything else is a
    Python exception whose text can hold anything (transformers' continue_final_message error
    quotes the whole rendered chat, a tokenizer's repr its folder): logged, not sent."""
    if type(exc) is TemplateError and str(exc):
        text = str(exc).splitlines()[0]
        message = text if len(text) <= 300 else text[:300] + "..."
        return bad_request(f"the chat template could not render these messages: {message}", "messages",
                           "invalid_messages")
    logger.warning("the chat template failed on a request (answered 400)", exc_info=exc)
    return bad_request(f"the chat template could not render these messages ({type(exc).__name__})", "messages",
                       "invalid_messages")


async def guarded(chunks: AsyncIterator[str], stream: RequestStream) -> AsyncIterator[str]:
    """A stream's SSE chunks; an engine failure or a shed request after the stream had begun (its
    200 status is sent) becomes an error event and [DONE], and the engine request is aborted
    however the stream ends."""
    try:
        async for chunk in chunks:
            yield chunk
    except (EngineStepError, EngineShutdownError) as exc:
        yield sse(error_body(str(exc), "server_error", None, None))
        yield SSE_DONE
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), "server_error", None, "engine_dead"))
        yield SSE_DONE
    except RequestOverloaded as exc:
        yield sse(APIError(503, str(exc), code="overloaded").body())
        yield SSE_DONE
    finally:
        if not stream.finished:
            stream.abort()
        if stream.trace is not None:
            stream.trace.end(stream.final_outputs)


def finish_reason_of(sample: CompletionOutput) -> Optional[str]:
    return sample.finish_reason


def stop_holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop), default=1) - 1 if params.stop else 0


def text_delta(sample: CompletionOutput, state: ChoiceState, holdback: int, finished: bool) -> str:
    """New text of a choice since the last chunk, keeping `holdback` characters until it finishes."""
    text = sample.text
    end = len(text) if (finished or sample.finish_reason) else max(state.text_sent, len(text) - holdback)
    delta = text[state.text_sent:end]
    state.text_sent = max(state.text_sent, end)
    return delta


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

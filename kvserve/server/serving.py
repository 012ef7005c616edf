"""From a validated request to engine requests and back to OpenAI-shaped JSON or SSE.

`OpenAIServing` owns the server-side rules the engine cannot know (served model names, the n and
logprobs limits, context-length checks with a helpful message), tokenization off the event loop,
and the response formats: completions (with `echo` + `logprobs` in the shape lm-evaluation-
harness's local-completions reads: tokens, token_logprobs, top_logprobs, text_offset) and chat
completions, each streamed or not.

Streaming invariants:
- engine outputs are cumulative; each choice remembers how much text / how many tokens it sent;
- with stop strings, the last len(longest stop) - 1 characters are held back until the request
  finishes, because a stop string completed by a later token cuts text that would otherwise
  already have been sent;
- a client that goes away (stream cancelled, or a disconnect seen while a non-streamed request
  runs) aborts its engine requests at once, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from jinja2.defaults import DEFAULT_NAMESPACE as JINJA_GLOBALS
from jinja2.exceptions import TemplateError

from kvserve.engine.async_engine import AsyncEngine, EngineShutdownError, EngineStepError, RequestStream
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.sched.scheduler import RequestRejected
from kvserve.sched.slo import RequestOverloaded
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, bad_request, echo, error_body, from_value_error
from kvserve.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                     PrefixPinRequest, PrefixUnpinRequest, TokenizeRequest)

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
# Names the template's context binds itself (transformers' render call and its Jinja globals) or the
# tokenizer's special tokens: a client value under one of them would overwrite what the template reads.
_TEMPLATE_CONTEXT_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "raise_exception", "strftime_now",
    *JINJA_GLOBALS, "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
    "mask_token", "additional_special_tokens", "extra_special_tokens"})
# apply_chat_template arguments a chat request sets through fields of its own.
_REQUEST_FIELDS = frozenset({"add_generation_prompt", "continue_final_message"})


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


@dataclass
class SSEStream:
    """A streamed answer: the SSE text chunks, and the engine stream to abort if the response ends
    early for any reason (even before the first chunk was asked for)."""
    chunks: AsyncIterator[str]
    engine_stream: RequestStream


@dataclass
class _PromptInput:
    token_ids: list[int]
    text: Optional[str]        # the prompt text, when the client sent text (decoded lazily otherwise)


@dataclass
class _ChoiceState:
    """What one streamed choice has sent so far."""
    text_sent: int = 0
    tokens_sent: int = 0
    text_offset: int = 0
    finished: bool = False
    started: bool = False


@dataclass
class _UsageCounter:
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: dict[tuple[str, int], int] = field(default_factory=dict)

    def update(self, output: RequestOutput) -> None:
        self.prompt_tokens[output.request_id] = len(output.prompt_token_ids)
        for sample in output.outputs:
            self.completion_tokens[(output.request_id, sample.index)] = len(sample.token_ids)

    def as_dict(self) -> dict[str, int]:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, config: ServerConfig, model_names: list[str]) -> None:
        engine = async_engine.engine
        self.async_engine = async_engine
        self.config = config
        self.model_names = model_names
        # Read once: these never change after the engine is built, so the HTTP side may use them.
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.model.config.vocab_size)
        self.max_num_seqs = int(engine.config.scheduler_config.max_num_seqs)
        self.slo_ttft = engine.config.scheduler_config.slo_ttft
        self.created = int(time.time())
        # One worker: tokenizers are used by one HTTP-side thread at a time; long prompts and
        # chat templates never stall the event loop.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenize")
        self._token_text_cache: dict[int, str] = {}
        self._reserved_template_names = _reserved_template_names(self.tokenizer)

    def _check_not_rejected(self, output: RequestOutput) -> None:
        """Raises RequestOverloaded for a request the scheduler shed (it missed its TTFT deadline)."""
        if output.finished and any(sample.finish_reason == "rejected" for sample in output.outputs):
            raise RequestOverloaded(f"server overloaded: the request could not start within the {self.slo_ttft:g} s "
                                    f"TTFT target; retry later")

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

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

    def _sampling_params(self, req: Any, max_tokens: Optional[int], logprobs: Optional[int],
                         prompt_logprobs: Optional[int]) -> SamplingParams:
        top_k = req.top_k if req.top_k is not None else 0
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
                min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output)
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

    async def _run_in_tokenizer(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise bad_request(f"this model has no tokenizer, so {what} is not available; send token ids")
        return self.tokenizer

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            tokenizer = self.tokenizer
            text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else ""
            if len(self._token_text_cache) < 200_000:
                self._token_text_cache[token_id] = text
        return text

    # --- tokenization ----------------------------------------------------------------------------
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
                                  chat_template_kwargs: Optional[dict[str, Any]]) -> list[int]:
        """The conversation's prompt token ids. The template renders text (tokenize=False) and the
        text is encoded here, so nothing from the request reaches the tokenizer's arguments."""
        tokenizer = self._require_tokenizer("chat")
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        if add_generation_prompt and continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                              "continue_final_message")
        if continue_final_message and messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a final assistant message", "messages")
        variables = self._template_variables(chat_template_kwargs)
        conversation = [_template_message(m) for m in messages]

        def render_and_encode() -> list[int]:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tokenize=False,
                                                 **variables)
            # What apply_chat_template(tokenize=True) does: the template wrote the special tokens.
            return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
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
        for name, value in kwargs.items():
            param = f"chat_template_kwargs.{name[:64]}"
            if not _TEMPLATE_VARIABLE_NAME.fullmatch(name):
                raise bad_request(f"{param}: a template variable name is letters, digits and _ (not first), "
                                  f"at most 64 characters; got {echo(name)}", param)
            if name in self._reserved_template_names:
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

    async def _completion_prompts(self, req: CompletionRequest) -> list[_PromptInput]:
        prompt = req.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif not prompt:
            raise bad_request("prompt must not be empty", "prompt", "empty_prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if len(items) > self.config.max_prompts_per_request:
            raise bad_request(f"a request may carry at most {self.config.max_prompts_per_request} prompts, "
                              f"got {len(items)}", "prompt", "too_many_prompts")
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = await self.tokenize_text(item, req.add_special_tokens, "prompt")
                prompts.append(_PromptInput(ids, item))
            else:
                if any(not 0 <= t < self.vocab_size for t in item):
                    raise bad_request(f"prompt token ids must lie in [0, {self.vocab_size})", "prompt",
                                      "invalid_token_id")
                prompts.append(_PromptInput(list(item), None))
        return prompts

    # --- /v1/completions -------------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest, raw: Request, tenant: Optional[str]) -> Any:
        arrival_time = time.monotonic()     # TTFT targets count tokenization and the queue for it
        model = self.check_model(req.model)
        self._check_common(req, req.logprobs, "logprobs")
        tenant = self.resolve_tenant(tenant, req.tenant)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (only best_of == n)", "best_of", "unsupported")
        # Parameters first: a bad value is reported without tokenizing anything.
        echo_logprobs = req.logprobs if req.echo else None
        params = self._sampling_params(req, req.max_tokens, req.logprobs, echo_logprobs)
        prompts = await self._completion_prompts(req)
        for prompt in prompts:
            self._check_length(len(prompt.token_ids), req.max_tokens, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._submit(request_id, [p.token_ids for p in prompts], params, req, tenant, arrival_time)
        sub_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        if req.stream:
            chunks = self._stream_completion(request_id, model, req, params, prompts, sub_ids, stream)
            return SSEStream(_guarded(chunks, stream), stream)
        finals = await self._collect(stream, raw)
        return self._completion_response(request_id, model, req, params, prompts, sub_ids, finals)

    async def _submit(self, request_id: str, prompt_ids: list[list[int]], params: SamplingParams, req: Any,
                      tenant: Optional[str], arrival_time: float) -> RequestStream:
        """Queues the prompts under `tenant` (already resolved by resolve_tenant); `arrival_time` is
        when the request reached the server (time.monotonic())."""
        engine = self.async_engine
        stream = engine.open_stream()
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
                                         arrival_time=arrival_time)
        except EngineShutdownError as exc:
            stream.abort()
            raise APIError(503, str(exc), code="server_shutting_down") from None
        except RequestOverloaded as exc:
            stream.abort()
            raise APIError(503, str(exc), code="overloaded") from None
        except RequestRejected as exc:   # the prompt can never run; the message is written for clients
            stream.abort()
            raise from_value_error(exc, "prompt") from None
        except BaseException:
            stream.abort()
            raise
        return stream

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
        except RequestOverloaded as exc:
            raise APIError(503, str(exc), code="overloaded") from None
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
            if not stream.finished:
                stream.abort()
        return finals

    def _completion_response(self, request_id: str, model: str, req: CompletionRequest, params: SamplingParams,
                             prompts: list[_PromptInput], sub_ids: list[str],
                             finals: dict[str, RequestOutput]) -> dict[str, Any]:
        choices, usage = [], _UsageCounter()
        for prompt_index, (prompt, sub_id) in enumerate(zip(prompts, sub_ids)):
            output = finals[sub_id]
            usage.update(output)
            for sample in output.outputs:
                text, logprobs = sample.text, None
                prompt_text = self._prompt_text(prompt) if req.echo else ""
                if req.logprobs is not None:
                    logprobs = _empty_completion_logprobs()
                    offset = 0 if req.echo else len(self._prompt_text(prompt))
                    if req.echo:
                        offset = self._add_prompt_logprobs(logprobs, output, req.logprobs, offset)
                    self._add_sample_logprobs(logprobs, sample, 0, req.logprobs, offset)
                choices.append({"index": prompt_index * params.n + sample.index, "text": prompt_text + text,
                                "logprobs": logprobs, "finish_reason": _finish_reason(sample),
                                "stop_reason": sample.stop_reason})
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.as_dict()}

    def _prompt_text(self, prompt: _PromptInput) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""
        return prompt.text

    def _add_prompt_logprobs(self, logprobs: dict[str, list], output: RequestOutput, num_top: int,
                             offset: int) -> int:
        entries = output.prompt_logprobs or []
        for position, token_id in enumerate(output.prompt_token_ids):
            entry = entries[position] if position < len(entries) else None
            token = self.token_text(token_id)
            logprobs["tokens"].append(token)
            logprobs["text_offset"].append(offset)
            offset += len(token)
            if entry is None:
                logprobs["token_logprobs"].append(None)
                logprobs["top_logprobs"].append(None)
            else:
                logprobs["token_logprobs"].append(entry.get(token_id))
                logprobs["top_logprobs"].append(self._top_dict(entry, token_id, num_top))
        return offset

    def _add_sample_logprobs(self, logprobs: dict[str, list], sample: CompletionOutput, start: int,
                             num_top: int, offset: int) -> int:
        entries = sample.logprobs or []
        for position in range(start, min(len(sample.token_ids), len(entries))):
            token_id, entry = sample.token_ids[position], entries[position]
            token = self.token_text(token_id)
            logprobs["tokens"].append(token)
            logprobs["text_offset"].append(offset)
            offset += len(token)
            logprobs["token_logprobs"].append(entry.get(token_id))
            logprobs["top_logprobs"].append(self._top_dict(entry, token_id, num_top))
        return offset

    def _top_dict(self, entry: dict[int, float], token_id: int, num_top: int) -> dict[str, float]:
        """The chosen token plus the num_top most likely ones, keyed by token text (as OpenAI does)."""
        top: dict[str, float] = {}
        if token_id in entry:
            top[self.token_text(token_id)] = entry[token_id]
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num_top]
        for alt_id, alt_lp in ranked:
            top.setdefault(self.token_text(alt_id), alt_lp)
        return top

    async def _stream_completion(self, request_id: str, model: str, req: CompletionRequest,
                                 params: SamplingParams, prompts: list[_PromptInput], sub_ids: list[str],
                                 stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())
        index_of = {sub_id: i for i, sub_id in enumerate(sub_ids)}
        states: dict[tuple[str, int], _ChoiceState] = {}
        usage = _UsageCounter()
        holdback = _stop_holdback(params)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        async for output in stream:
            self._check_not_rejected(output)
            usage.update(output)
            prompt_index = index_of[output.request_id]
            prompt = prompts[prompt_index]
            choices = []
            for sample in output.outputs:
                state = states.setdefault((output.request_id, sample.index), _ChoiceState())
                if state.finished:
                    continue
                text, logprobs = "", None
                if not state.started:
                    state.started = True
                    if req.echo:
                        text = self._prompt_text(prompt)
                    if req.logprobs is not None:
                        state.text_offset = 0 if req.echo else len(self._prompt_text(prompt))
                        if req.echo:
                            logprobs = _empty_completion_logprobs()
                            state.text_offset = self._add_prompt_logprobs(logprobs, output, req.logprobs, 0)
                new_text = _text_delta(sample, state, holdback, output.finished)
                text += new_text
                if req.logprobs is not None and len(sample.token_ids) > state.tokens_sent:
                    logprobs = logprobs or _empty_completion_logprobs()
                    state.text_offset = self._add_sample_logprobs(logprobs, sample, state.tokens_sent,
                                                                  req.logprobs, state.text_offset)
                state.tokens_sent = len(sample.token_ids)
                finish_reason = _finish_reason(sample) if sample.finish_reason else None
                state.finished = finish_reason is not None
                if not text and logprobs is None and finish_reason is None:
                    continue
                choices.append({"index": prompt_index * params.n + sample.index, "text": text,
                                "logprobs": logprobs, "finish_reason": finish_reason,
                                "stop_reason": sample.stop_reason if finish_reason else None})
            if choices:
                chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                         "choices": choices}
                if continuous:
                    chunk["usage"] = usage.as_dict()
                yield _sse(chunk)
        if include_usage:
            yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": usage.as_dict()})
        yield _SSE_DONE

    # --- /v1/chat/completions ----------------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request, tenant: Optional[str]) -> Any:
        arrival_time = time.monotonic()     # TTFT targets count the chat template and the queue for it
        model = self.check_model(req.model)
        top = req.top_logprobs if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        self._check_common(req, top, "top_logprobs")
        tenant = self.resolve_tenant(tenant, req.tenant)
        if not req.messages:
            raise bad_request("messages must contain at least one message", "messages", "empty_messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, logprobs, None)
        prompt_ids = await self.apply_chat_template(req.messages, req.add_generation_prompt,
                                                    req.continue_final_message, req.chat_template_kwargs)
        self._check_length(len(prompt_ids), max_tokens, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._submit(request_id, [prompt_ids], params, req, tenant, arrival_time)
        sub_id = f"{request_id}-0"
        if req.stream:
            chunks = self._stream_chat(request_id, model, req, params, sub_id, stream)
            return SSEStream(_guarded(chunks, stream), stream)
        finals = await self._collect(stream, raw)
        output = finals[sub_id]
        choices = []
        for sample in output.outputs:
            choices.append({
                "index": sample.index, "message": {"role": "assistant", "content": sample.text},
                "logprobs": {"content": self._chat_logprobs(sample, 0, req.top_logprobs or 0)} if req.logprobs else None,
                "finish_reason": _finish_reason(sample), "stop_reason": sample.stop_reason})
        usage = _UsageCounter()
        usage.update(output)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.as_dict()}

    def _chat_logprobs(self, sample: CompletionOutput, start: int, num_top: int) -> list[dict[str, Any]]:
        content = []
        entries = sample.logprobs or []
        for position in range(start, min(len(sample.token_ids), len(entries))):
            token_id, entry = sample.token_ids[position], entries[position]
            ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num_top]
            content.append({**self._chat_token(token_id, entry.get(token_id, float("-inf"))),
                            "top_logprobs": [self._chat_token(t, lp) for t, lp in ranked]})
        return content

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    async def _stream_chat(self, request_id: str, model: str, req: ChatCompletionRequest, params: SamplingParams,
                           sub_id: str, stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        states = [_ChoiceState() for _ in range(params.n)]
        usage = _UsageCounter()
        holdback = _stop_holdback(params)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        # The role comes first, before any token exists (what OpenAI's stream does).
        yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None} for i in range(params.n)]})
        async for output in stream:
            self._check_not_rejected(output)
            usage.update(output)
            choices = []
            for sample in output.outputs:
                state = states[sample.index]
                if state.finished:
                    continue
                text = _text_delta(sample, state, holdback, output.finished)
                logprobs = None
                if req.logprobs and len(sample.token_ids) > state.tokens_sent:
                    logprobs = {"content": self._chat_logprobs(sample, state.tokens_sent, req.top_logprobs or 0)}
                state.tokens_sent = len(sample.token_ids)
                finish_reason = _finish_reason(sample) if sample.finish_reason else None
                state.finished = finish_reason is not None
                if not text and logprobs is None and finish_reason is None:
                    continue
                choices.append({"index": sample.index, "delta": {"content": text} if text else {},
                                "logprobs": logprobs, "finish_reason": finish_reason,
                                "stop_reason": sample.stop_reason if finish_reason else None})
            if choices:
                chunk = {**base, "choices": choices}
                if continuous:
                    chunk["usage"] = usage.as_dict()
                yield _sse(chunk)
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage.as_dict()})
        yield _SSE_DONE

    # --- /v1/tokenize, /v1/detokenize ----------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must contain at least one message", "messages", "empty_messages")
            ids = await self.apply_chat_template(req.messages, req.add_generation_prompt, False,
                                                 req.chat_template_kwargs)
        else:
            ids = await self.tokenize_text(req.prompt, req.add_special_tokens, "prompt")
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    # --- /v1/prefix/pin, /v1/prefix/unpin, /v1/prefix/pins ----------------------------------------
    async def pin_prefix(self, req: PrefixPinRequest, tenant: Optional[str]) -> dict[str, Any]:
        self.check_model(req.model)
        tenant = self.resolve_tenant(tenant, req.tenant)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must contain at least one message", "messages", "empty_messages")
            ids = await self.apply_chat_template(req.messages, False, False, None)
        elif isinstance(req.prompt, str):
            ids = await self.tokenize_text(req.prompt, req.add_special_tokens, "prompt")
        else:
            if any(not 0 <= t < self.vocab_size for t in req.prompt):
                raise bad_request(f"prompt token ids must lie in [0, {self.vocab_size})", "prompt", "invalid_token_id")
            ids = list(req.prompt)

        def pin(engine: Any) -> dict[str, Any]:
            return engine.pin_prefix({"prompt_token_ids": ids}, req.ttl, tenant=tenant, cache_salt=req.cache_salt,
                                     num_tokens=req.num_tokens).as_dict()
        try:
            return await self.async_engine.call(pin)
        except EngineShutdownError as exc:
            raise APIError(503, str(exc), code="server_shutting_down") from None
        except ValueError as exc:
            raise from_value_error(exc, "prompt") from None

    async def unpin_prefix(self, req: PrefixUnpinRequest, tenant: Optional[str]) -> dict[str, Any]:
        tenant = self.resolve_tenant(tenant, req.tenant)
        try:
            removed = await self.async_engine.call(lambda engine: engine.unpin_prefix(req.id, tenant=tenant))
        except EngineShutdownError as exc:
            raise APIError(503, str(exc), code="server_shutting_down") from None
        if not removed:
            raise APIError(404, f"no pin {echo(req.id)} of this tenant", param="id", code="pin_not_found")
        return {"id": req.id, "object": "prefix_pin", "deleted": True}

    async def list_pins(self, tenant: Optional[str], requested: Optional[str]) -> dict[str, Any]:
        tenant = self.resolve_tenant(tenant, requested)
        try:
            pins = await self.async_engine.call(lambda engine: [p.as_dict() for p in engine.prefix.pins(tenant)])
        except EngineShutdownError as exc:
            raise APIError(503, str(exc), code="server_shutting_down") from None
        return {"object": "list", "data": pins}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if any(not 0 <= t < self.vocab_size for t in req.tokens):
            raise bad_request(f"tokens must lie in [0, {self.vocab_size})", "tokens", "invalid_token_id")
        tokenizer = self._require_tokenizer("detokenize")
        text = await self._run_in_tokenizer(lambda: tokenizer.decode(req.tokens))
        return {"prompt": text}


def _template_message(message: ChatMessage) -> dict[str, str]:
    rendered = {"role": message.role, "content": _message_text(message)}
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _reserved_template_names(tokenizer: Any) -> frozenset[str]:
    """Names chat_template_kwargs may not use: apply_chat_template's own parameters (read from its
    signature, so a new tokenizer argument is refused too), the template context's names, and the
    tokenizer's special tokens (which the context binds as variables)."""
    if tokenizer is None:
        return _TEMPLATE_CONTEXT_NAMES
    parameters = inspect.signature(type(tokenizer).apply_chat_template).parameters.values()
    own = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(own | _TEMPLATE_CONTEXT_NAMES | set(tokenizer.special_tokens_map))


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


def _message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _empty_completion_logprobs() -> dict[str, list]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


async def _guarded(chunks: AsyncIterator[str], stream: RequestStream) -> AsyncIterator[str]:
    """A stream's SSE chunks; an engine failure or a shed request after the stream had begun (its
    200 status is sent) becomes an error event and [DONE], and the engine request is aborted
    however the stream ends."""
    try:
        async for chunk in chunks:
            yield chunk
    except (EngineStepError, EngineShutdownError) as exc:
        yield _sse(error_body(str(exc), "server_error", None, None))
        yield _SSE_DONE
    except RequestOverloaded as exc:
        yield _sse(APIError(503, str(exc), code="overloaded").body())
        yield _SSE_DONE
    finally:
        if not stream.finished:
            stream.abort()


def _finish_reason(sample: CompletionOutput) -> Optional[str]:
    return sample.finish_reason


def _stop_holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop), default=1) - 1 if params.stop else 0


def _text_delta(sample: CompletionOutput, state: _ChoiceState, holdback: int, finished: bool) -> str:
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

"""/v1/chat/completions: messages (and tools) -> the chat template (ChatTemplate, shared with
LLM.chat) -> the assistant's reply, streamed (role first, then content deltas) or not; its think
split off by the reasoning parser (reasoning.py), its tool calls read per tool_choice (tools.py)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request

from kvserve.engine.client import RequestStream
from kvserve.engine.outputs import CompletionOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import bad_request, from_value_error
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.reasoning import ReasoningStream
from kvserve.server.tool_parsers import ToolCall, ToolCallStream
from kvserve.server.tools import ToolMode, forced_calls, openai_tool_calls, tool_mode
from kvserve.server.serving_base import (SSE_DONE, ChoiceState, OpenAIServing, SSEStream, UsageCounter,
                                         finish_reason_of, guarded, sse, stop_holdback, text_delta)


class OpenAIServingChat(OpenAIServing):
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
        tools = self._tool_mode(req, params)
        if tools.constraint is not None:
            params = dataclasses.replace(params, structured_output=tools.constraint)
        prompt_ids = await self.apply_chat_template(req.messages, req.add_generation_prompt,
                                                    req.continue_final_message, req.chat_template_kwargs,
                                                    tools.tools)
        self._check_length(len(prompt_ids), max_tokens, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        parser = self.context.reasoning
        # Whether the output starts inside a think: R1 always; qwen3 if the template left one open.
        in_reasoning = parser is not None and parser.starts_in_reasoning(
            self.tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False) if self.tokenizer is not None else "")
        stream = await self._submit(request_id, [prompt_ids], params, req, tenant, arrival_time, raw)
        sub_id = f"{request_id}-0"
        if req.stream:
            chunks = self._stream_chat(request_id, model, req, params, sub_id, stream, in_reasoning, tools)
            return SSEStream(guarded(chunks, stream), stream)
        finals = await self._collect(stream, raw)
        output = finals[sub_id]
        choices = []
        usage = UsageCounter()
        usage.update(output)
        for sample in output.outputs:
            message = {"role": "assistant", "content": sample.text}
            if parser is not None:
                message["reasoning_content"], message["content"] = parser.split(sample.text, in_reasoning)
                self._count_reasoning(usage, output.request_id, sample, in_reasoning)
            finish_reason = finish_reason_of(sample)
            if tools.reads_calls:
                content, calls = _read_calls(tools, message["content"])
                if calls:
                    message["content"], message["tool_calls"] = content, openai_tool_calls(calls)
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choices.append({
                "index": sample.index, "message": message,
                "logprobs": {"content": self._chat_logprobs(sample, 0, req.top_logprobs or 0)} if req.logprobs else None,
                "finish_reason": finish_reason, "stop_reason": sample.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.as_dict()}

    def _tool_mode(self, req: ChatCompletionRequest, params: SamplingParams) -> ToolMode:
        config = self.context.config
        try:
            mode = tool_mode(req, config.tool_call_parser, config.enable_auto_tool_choice)
        except ValueError as exc:
            raise from_value_error(exc, "tools") from None
        if mode.constraint is not None and params.structured_output is not None:
            raise bad_request(f"tool_choice {mode.forced!r} constrains the reply: it cannot be combined with "
                              f"{params.structured_output.source}", "tool_choice")
        return mode

    def _count_reasoning(self, usage: UsageCounter, request_id: str, sample: CompletionOutput,
                         in_reasoning: bool) -> None:
        if usage.reasoning_tokens is None:
            usage.reasoning_tokens = {}
        usage.reasoning_tokens[(request_id, sample.index)] = self.context.reasoning.reasoning_tokens(
            sample.token_ids, self.tokenizer.decode, in_reasoning)

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
                           sub_id: str, stream: RequestStream, in_reasoning: bool,
                           tools: ToolMode) -> AsyncIterator[str]:
        created = int(time.time())
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        states = [ChoiceState() for _ in range(params.n)]
        parser = self.context.reasoning
        splits = [ReasoningStream(parser, in_reasoning) for _ in range(params.n)] if parser is not None else None
        calls = [_CallStream(tools) for _ in range(params.n)] if tools.reads_calls else None
        usage = UsageCounter()
        holdback = stop_holdback(params)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        # The role comes first, before any token exists (what OpenAI's stream does).
        yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None} for i in range(params.n)]})
        async for output in stream:
            self._check_not_rejected(output)
            usage.update(output)
            choices = []
            for sample in output.outputs:
                state = states[sample.index]
                if state.finished:
                    continue
                final = output.finished or bool(sample.finish_reason)
                if splits is not None:
                    visible = sample.text if final else sample.text[:max(0, len(sample.text) - holdback)]
                    reasoning, text = splits[sample.index].delta(visible, final)
                    if final:
                        self._count_reasoning(usage, output.request_id, sample, in_reasoning)
                else:
                    reasoning, text = "", text_delta(sample, state, holdback, output.finished)
                new_calls: list[dict[str, Any]] = []
                if calls is not None:
                    text, new_calls = calls[sample.index].delta(text, final)
                delta = {"reasoning_content": reasoning} if reasoning else {}
                if text:
                    delta["content"] = text
                if new_calls:
                    delta["tool_calls"] = new_calls
                logprobs = None
                if req.logprobs and len(sample.token_ids) > state.tokens_sent:
                    logprobs = {"content": self._chat_logprobs(sample, state.tokens_sent, req.top_logprobs or 0)}
                state.tokens_sent = len(sample.token_ids)
                finish_reason = finish_reason_of(sample) if sample.finish_reason else None
                if finish_reason == "stop" and calls is not None and calls[sample.index].sent:
                    finish_reason = "tool_calls"
                state.finished = finish_reason is not None
                if not delta and logprobs is None and finish_reason is None:
                    continue
                choices.append({"index": sample.index, "delta": delta,
                                "logprobs": logprobs, "finish_reason": finish_reason,
                                "stop_reason": sample.stop_reason if finish_reason else None})
            if choices:
                chunk = {**base, "choices": choices}
                if continuous:
                    chunk["usage"] = usage.as_dict()
                yield sse(chunk)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage.as_dict()})
        yield SSE_DONE



def _read_calls(mode: ToolMode, content: Optional[str]) -> tuple[Optional[str], list[ToolCall]]:
    """A whole reply's content (after any think) -> (content left, tool calls)."""
    text = content or ""
    if mode.forced is not None:
        found = forced_calls(mode, text)
        return (None if found else text), found
    parsed = mode.parser.parse(text)
    return parsed.content, parsed.tool_calls


class _CallStream:
    """One choice's stream of content deltas -> content and tool-call deltas. With a parser, calls go
    out as their closing markers arrive; a reply the grammar constrains (tool_choice required or
    named) is a JSON text, held back and read once it ends."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0
        self.parsed = ToolCallStream(mode.parser) if mode.parser is not None else None

    def delta(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += text
        if self.parsed is not None:
            content, found = self.parsed.delta(self.text, final)
        elif final:
            found = forced_calls(self.mode, self.text)
            content = "" if found else self.text
        else:
            content, found = "", []
        rendered = openai_tool_calls(found, stream=True, first_index=self.sent)
        self.sent += len(found)
        return content, rendered

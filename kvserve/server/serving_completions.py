"""/v1/completions: prompts (text or token ids, one or many) -> completions, streamed or not.

`echo` + `logprobs` come in the shape lm-evaluation-harness's local-completions reads (tokens,
token_logprobs, top_logprobs, text_offset).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import Request

from kvserve.engine.client import RequestStream
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import CompletionRequest
from kvserve.server.serving_base import (SSE_DONE, ChoiceState, OpenAIServing, SSEStream, UsageCounter,
                                         finish_reason_of, guarded, sse, stop_holdback, text_delta)


@dataclass
class PromptInput:
    token_ids: list[int]
    text: Optional[str]        # the prompt text, when the client sent text (decoded lazily otherwise)


class OpenAIServingCompletion(OpenAIServing):
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
        stream = await self._submit(request_id, [p.token_ids for p in prompts], params, req, tenant, arrival_time,
                                    raw)
        sub_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        if req.stream:
            chunks = self._stream_completion(request_id, model, req, params, prompts, sub_ids, stream)
            return SSEStream(guarded(chunks, stream), stream)
        finals = await self._collect(stream, raw)
        return self._completion_response(request_id, model, req, params, prompts, sub_ids, finals)

    async def _completion_prompts(self, req: CompletionRequest) -> list[PromptInput]:
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
                prompts.append(PromptInput(ids, item))
            else:
                self._check_token_ids(item, "prompt token ids", "prompt")
                prompts.append(PromptInput(list(item), None))
        return prompts

    def _completion_response(self, request_id: str, model: str, req: CompletionRequest, params: SamplingParams,
                             prompts: list[PromptInput], sub_ids: list[str],
                             finals: dict[str, RequestOutput]) -> dict[str, Any]:
        choices, usage = [], UsageCounter()
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
                                "logprobs": logprobs, "finish_reason": finish_reason_of(sample),
                                "stop_reason": sample.stop_reason})
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.as_dict()}

    def _prompt_text(self, prompt: PromptInput) -> str:
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
                                 params: SamplingParams, prompts: list[PromptInput], sub_ids: list[str],
                                 stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())
        index_of = {sub_id: i for i, sub_id in enumerate(sub_ids)}
        states: dict[tuple[str, int], ChoiceState] = {}
        usage = UsageCounter()
        holdback = stop_holdback(params)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        async for output in stream:
            self._check_not_rejected(output)
            usage.update(output)
            prompt_index = index_of[output.request_id]
            prompt = prompts[prompt_index]
            choices = []
            for sample in output.outputs:
                state = states.setdefault((output.request_id, sample.index), ChoiceState())
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
                new_text = text_delta(sample, state, holdback, output.finished)
                text += new_text
                if req.logprobs is not None and len(sample.token_ids) > state.tokens_sent:
                    logprobs = logprobs or _empty_completion_logprobs()
                    state.text_offset = self._add_sample_logprobs(logprobs, sample, state.tokens_sent,
                                                                  req.logprobs, state.text_offset)
                state.tokens_sent = len(sample.token_ids)
                finish_reason = finish_reason_of(sample) if sample.finish_reason else None
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
                yield sse(chunk)
        if include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": usage.as_dict()})
        yield SSE_DONE



def _empty_completion_logprobs() -> dict[str, list]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

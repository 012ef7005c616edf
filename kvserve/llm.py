"""Offline API in the shape vLLM users know: LLM(model).generate(prompts, params) / .chat(messages)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

from kvserve.engine.chat_template import ChatTemplate
from kvserve.engine.engine import Engine, PromptInput
from kvserve.engine.outputs import RequestOutput
from kvserve.model.loader.generation_config import sampling_defaults
from kvserve.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    def __init__(self, model: Optional[str] = None, **engine_options: Any) -> None:
        self.engine = Engine.from_options(model=model, **engine_options)
        self.chat_template = ChatTemplate(self.engine.tokenizer)     # the one the server renders with too
        self._sampling_defaults = sampling_defaults(str(self.engine.source.path))     # read once

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling params (vLLM's name): SamplingParams with the model's
        generation_config.json defaults (R1: temperature 0.6, top_p 0.95) over kvserve's own."""
        return SamplingParams(**self._sampling_defaults)

    def close(self) -> None:
        """Finishes the disk / remote KV tiers' writes (a later run finds them); idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def generate(self, prompts: Union[PromptInput, Sequence[PromptInput]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """priority (one per prompt, as in vLLM): with --scheduling-policy priority, lower first."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"{len(priorities)} priorities for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, use_tqdm, priorities)

    def chat(self, messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
             sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict[str, Any]] = None, *, continue_final_message: bool = False,
             tools: Optional[list[dict[str, Any]]] = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt, chat_template_kwargs,
                                                                 continue_final_message=continue_final_message,
                                                                 tools=tools)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: Sequence[Message], add_generation_prompt: bool = True,
                            chat_template_kwargs: Optional[dict[str, Any]] = None, *,
                            continue_final_message: bool = False,
                            tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """The conversation's prompt token ids, rendered as the server's chat endpoint renders them
        (kvserve/engine/chat_template.py); raises ValueError (NoChatTemplateError) without a template."""
        return self.chat_template.encode(conversation, add_generation_prompt, continue_final_message, tools,
                                         chat_template_kwargs)

    def _run(self, prompts: list[PromptInput], params: list[SamplingParams], use_tqdm: bool,
             priorities: Optional[list[int]] = None) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        priorities = priorities or [0] * len(prompts)
        try:
            for prompt, p, priority in zip(prompts, params, priorities):
                # Only finished outputs are returned: skip the per-step snapshots streaming needs.
                ids.append(engine.add_request(None, prompt, dataclasses.replace(p, output_kind="final_only"),
                                              priority=priority))
        except Exception:
            for request_id in ids:
                engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        pending = set(ids)
        try:
            while pending:
                for output in engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in pending:
                engine.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        engine.flush_tiers()         # the last steps' blocks, down to disk / Redis before returning
        return [finished[request_id] for request_id in ids]


def _as_prompt_list(prompts: Union[PromptInput, Sequence[PromptInput]]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]   # one prompt given as token ids
    return prompts

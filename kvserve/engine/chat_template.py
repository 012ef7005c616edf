"""The chat-template renderer: a conversation -> prompt token ids, one way for `LLM.chat` and the server.

The tokenizer's template renders text (`tokenize=False`) and the text is then encoded without added
special tokens (the template wrote them), which is what transformers' `apply_chat_template(tokenize=
True)` does; so the same messages give the engine the same ids whichever door they came in by, and
nothing the caller passes as a template variable reaches the tokenizer's encoding arguments.

What is the renderer's and what is its callers': the renderer knows the template (is there one, which
flags combine, which names are template variables at all: `reserved_names`); the server adds the
limits an untrusted client needs (how many variables, how big, which names it may not use), and maps
`ChatTemplateError` to a 400 naming `param`. `LLM.chat` passes its caller's variables (and `tools`)
through as they are.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Mapping, Optional, Sequence

from jinja2.defaults import DEFAULT_NAMESPACE as JINJA_GLOBALS

Message = Mapping[str, Any]

# Names the template's context binds itself (transformers' render call and its Jinja globals) or the
# tokenizer's special tokens: a variable under one of them would overwrite what the template reads.
TEMPLATE_CONTEXT_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "raise_exception", "strftime_now",
    *JINJA_GLOBALS, "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
    "mask_token", "additional_special_tokens", "extra_special_tokens"})


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered as asked (before the template runs); `param` names the
    argument (request field) at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class NoChatTemplateError(ChatTemplateError):
    """The model has no tokenizer or its tokenizer has no chat template."""


class ChatTemplate:
    """The tokenizer's chat template. `encode` is what callers use; `check` runs its argument checks
    alone (cheap: the server runs them on the event loop before the render goes to a worker thread);
    exceptions the template itself raises (raise_exception, Jinja errors) propagate unchanged."""

    def __init__(self, tokenizer: Any, template: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.template = template         # --chat-template: used instead of the tokenizer's
        self._reserved_names: Optional[frozenset[str]] = None

    @property
    def _template(self) -> Optional[str]:
        return self.template or (self.tokenizer.chat_template if self.tokenizer is not None else None)

    @property
    def available(self) -> bool:
        return self.tokenizer is not None and bool(self._template)

    @property
    def reserved_names(self) -> frozenset[str]:
        """Names that are not template variables: apply_chat_template's own parameters (read from its
        signature, so a new tokenizer argument is refused too), the template context's names, and the
        tokenizer's special tokens (which the context binds as variables)."""
        if self._reserved_names is None:
            names = set(TEMPLATE_CONTEXT_NAMES)
            if self.tokenizer is not None:
                parameters = inspect.signature(type(self.tokenizer).apply_chat_template).parameters.values()
                names |= {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
                names |= set(self.tokenizer.special_tokens_map)
            self._reserved_names = frozenset(names)
        return self._reserved_names

    def check(self, messages: Sequence[Message], add_generation_prompt: bool = True,
              continue_final_message: bool = False) -> None:
        """Raises ChatTemplateError (NoChatTemplateError without a template) for arguments the
        template cannot render."""
        if self.tokenizer is None:
            raise NoChatTemplateError("this model has no tokenizer, so it has no chat template")
        if not self._template:
            raise NoChatTemplateError("this model has no chat template")
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true",
                                    "continue_final_message")
        if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise ChatTemplateError("continue_final_message needs a final assistant message", "messages")

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Optional[list[dict[str, Any]]] = None,
               variables: Optional[Mapping[str, Any]] = None) -> str:
        """The prompt text. `tools` (JSON schemas, as transformers takes them) and `variables` (more
        template variables, e.g. enable_thinking) go to the template as given."""
        self.check(messages, add_generation_prompt, continue_final_message)
        extra = dict(variables or {})
        if tools is not None:
            extra["tools"] = tools
        if self.template is not None:
            extra["chat_template"] = self.template
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message, tokenize=False,
                                                  **extra)

    def encode(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Optional[list[dict[str, Any]]] = None,
               variables: Optional[Mapping[str, Any]] = None) -> list[int]:
        """The prompt token ids: the rendered text encoded without added special tokens."""
        text = self.render(messages, add_generation_prompt, continue_final_message, tools, variables)
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]


def read_chat_template(given: Optional[str]) -> Optional[str]:
    """--chat-template: the contents of a file, or the template itself when no such file exists (a
    value with Jinja markup); None when not given. A path-like value naming no file is an error."""
    if given is None:
        return None
    if os.path.isfile(given):
        with open(given, encoding="utf-8") as f:
            return f.read()
    if "{{" in given or "{%" in given:
        return given
    raise ValueError(f"--chat-template {given!r}: no such file, and not a Jinja template either")

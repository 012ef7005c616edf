"""Reasoning output (`--reasoning-parser deepseek_r1|qwen3`): the text a model thinks in, between
`<think>` and `</think>`, goes to a chat message's `reasoning_content` and the rest to `content`,
as vLLM and SGLang return it; streamed as deltas of either field.

The two parsers differ only in where the reasoning may start:
- deepseek_r1: R1's chat template ends the prompt inside `<think>`, and R1 checkpoints sometimes
  emit no `<think>` at all, so an output is reasoning until `</think>` (a `<think>` it does emit
  at the start is dropped). An output that never closes its think (cut at max_tokens) is all
  reasoning.
- qwen3: reasoning only when the output opens `<think>` itself, or when the prompt ends inside an
  opened `<think>` (a template that opens it); otherwise all of it is content.

Splitting works on the whole text each time (`split`), so a tag split across tokens or stream chunks
is found once its last piece arrives; while the text ends with what could be the start of a tag,
the stream holds those characters back (`ReasoningStream`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    name: str

    def __post_init__(self) -> None:
        if self.name not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {PARSERS}, got {self.name!r}")

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """Whether the output begins inside a think: always for R1; for qwen3, when the prompt
        (its chat template) left a `<think>` open."""
        if self.name == "deepseek_r1":
            return True
        return prompt_text.rfind(START) > prompt_text.rfind(END)

    def split(self, text: str, in_reasoning: bool) -> tuple[Optional[str], str]:
        """(reasoning or None, content) of a whole output."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            text, in_reasoning = stripped[len(START):], True
        if not in_reasoning:
            return None, text
        end = text.find(END)
        if end < 0:
            return text, ""                 # never closed: all of it is reasoning
        return text[:end], text[end + len(END):].lstrip("\n")

    def reasoning_tokens(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                         in_reasoning: bool) -> int:
        """Output tokens up to the end of the think (all of them if it never closes), found by
        bisection over decoded prefixes; 0 without reasoning."""
        text = decode(token_ids)
        reasoning, _ = self.split(text, in_reasoning)
        if reasoning is None:
            return 0
        if END not in text:
            return len(token_ids)
        low, high = 1, len(token_ids)        # the shortest prefix whose text holds the end tag
        while low < high:
            middle = (low + high) // 2
            if END in decode(token_ids[:middle]):
                high = middle
            else:
                low = middle + 1
        return low


def _partial_tag_suffix(text: str) -> int:
    """Characters at the end of `text` that could be the start of a tag still arriving."""
    for size in range(min(len(text), len(END) - 1), 0, -1):
        tail = text[-size:]
        if END.startswith(tail) or START.startswith(tail):
            return size
    return 0


@dataclass
class ReasoningStream:
    """One streamed choice: which part of the reasoning and the content has been sent."""
    parser: ReasoningParser
    in_reasoning: bool
    reasoning_sent: int = 0
    content_sent: int = 0

    def delta(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) of the output's text so far."""
        if not final:
            text = text[:len(text) - _partial_tag_suffix(text)]
        if not final and not text.strip():
            return "", ""                   # a leading "<think>" may still be coming
        reasoning, content = self.parser.split(text, self.in_reasoning)
        reasoning = reasoning or ""
        new_reasoning, new_content = reasoning[self.reasoning_sent:], content[self.content_sent:]
        self.reasoning_sent, self.content_sent = len(reasoning), len(content)
        return new_reasoning, new_content

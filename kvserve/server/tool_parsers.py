"""Tool calls (`--tool-call-parser hermes|llama3_json|deepseek_v3`, vLLM's names): the calls a
model writes into its text, in the format its chat template taught it, go to a chat message's
`tool_calls` (OpenAI's shape: a name and the arguments as a JSON text) and the rest to `content`.

The formats:
- hermes (Hermes, Qwen2.5, Qwen3, R1-Distill-Qwen): `<tool_call>{"name": .., "arguments": {..}}
  </tool_call>` blocks. The last block may lack its `</tool_call>` (a model that hit EOS early) and
  still counts when its JSON is complete.
- llama3_json (Llama 3.1/3.2): the whole output, after an optional `<|python_tag|>`, is a JSON
  object `{"name": .., "parameters": {..}}`, or several separated by `;`. A Llama reply has no
  marker that says "this is a call", so anything else (text around the JSON, an answer that is JSON
  but has no name) is content.
- deepseek_v3 (DeepSeek-V3, R1): `<｜tool▁calls▁begin｜>`, then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`, or V3.1's
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`.

A block that does not parse (bad JSON, no name) is not a call, and its text stays in the content,
so nothing the model wrote is lost. With no calls the content is the text unchanged; with calls it
is the text outside them less the whitespace between and after them (a template's separators),
or None when nothing else is left.

Parsing works on the whole text each time, as in reasoning.py. While streaming (`ToolCallStream`),
content before the first possible call start goes out once it cannot be the start of a marker;
after that the text is held back until the end, except that a call whose closing marker has come
is sent at once.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

TOOL_CALL_PARSERS: tuple[str, ...] = ("hermes", "llama3_json", "deepseek_v3")

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*(?:```)?", re.DOTALL)     # DeepSeek-V3's ```json ... ```
_SEPARATOR = re.compile(r"\s*(;?)\s*")                                  # between llama3 calls


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                      # a JSON text
    id: str = field(default_factory=_call_id, compare=False)     # equal calls may differ in id


@dataclass(frozen=True)
class ParsedToolCalls:
    content: Optional[str]
    tool_calls: list[ToolCall]


def _call(name: Any, arguments: Any) -> Optional[ToolCall]:
    """A call, None without a name; arguments that are not an object are kept as their JSON."""
    if not isinstance(name, str) or not name.strip():
        return None
    return ToolCall(name.strip(), json.dumps({} if arguments is None else arguments,
                                             ensure_ascii=False))


def _object_call(value: Any) -> Optional[ToolCall]:
    """`{"name": .., "arguments"|"parameters": ..}` as a call."""
    if not isinstance(value, dict):
        return None
    return _call(value.get("name"), value.get("arguments", value.get("parameters")))


def _loads(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def _hermes_call(body: str) -> Optional[ToolCall]:
    ok, value = _loads(body)
    return _object_call(value) if ok else None


def _deepseek_call(body: str) -> Optional[ToolCall]:
    name, sep, args = body.split(DS_CALLS_END)[0].partition(DS_SEP)
    if not sep:
        return None
    first, _, rest = args.strip().partition("\n")
    if name.strip() == "function" and not first.lstrip().startswith(("{", "[")):
        name, args = first, rest        # V3: the type, then the name above fenced JSON
    args = args.strip()
    fenced = _FENCE.fullmatch(args)
    ok, value = _loads(fenced.group(1) if fenced else args) if args else (True, {})
    return _call(name, value) if ok else None


class _Block(NamedTuple):
    start: int
    end: int
    call: Optional[ToolCall]            # None: not a call, its text stays content
    closed: bool


def _blocks(text: str, start: str, end: str, parse: Callable[[str], Optional[ToolCall]]
            ) -> list[_Block]:
    """Each `start ... end` span; an unclosed one runs to the end of the text."""
    blocks, at = [], text.find(start)
    while at >= 0:
        body_at, close = at + len(start), text.find(end, at + len(start))
        stop = len(text) if close < 0 else close + len(end)
        blocks.append(_Block(at, stop, parse(text[body_at:len(text) if close < 0 else close]),
                             close >= 0))
        at = text.find(start, stop)
    return blocks


def _llama3_calls(text: str) -> list[ToolCall]:
    """The calls if the whole text is `;`-separated call objects, else none."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return []
        call = _object_call(value)
        if call is None:
            return []
        calls.append(call)
        separator = _SEPARATOR.match(body, at)
        if separator.end() < len(body) and not separator.group(1):
            return []                   # text after a call that is not another call
        at = separator.end()
    return calls


def _partial_marker(text: str, marker: str) -> int:
    """Characters at the end of `text` that could be the start of `marker` still arriving."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True)
class ToolCallParser:
    name: str

    def __post_init__(self) -> None:
        if self.name not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, "
                             f"got {self.name!r}")

    def _blocks(self, text: str) -> list[_Block]:
        if self.name == "hermes":
            return _blocks(text, HERMES_START, HERMES_END, _hermes_call)
        if self.name == "deepseek_v3":
            return _blocks(text, DS_CALL_BEGIN, DS_CALL_END, _deepseek_call)
        return []

    def parse(self, text: str) -> ParsedToolCalls:
        """(content, calls) of a whole output."""
        if self.name == "llama3_json":
            calls = _llama3_calls(text)
            return ParsedToolCalls(None, calls) if calls else ParsedToolCalls(text, [])
        blocks = [block for block in self._blocks(text) if block.call is not None]
        if not blocks:
            return ParsedToolCalls(text, [])
        first = self.call_start(text)   # a full marker here, so before any call
        outside, at = [], first
        for block in blocks + [_Block(len(text), len(text), None, True)]:
            piece = text[at:block.start]
            if self.name == "deepseek_v3":
                piece = piece.replace(DS_CALLS_BEGIN, "").replace(DS_CALLS_END, "")
            outside.append(piece if piece.strip() else "")      # separators between calls
            at = block.end
        content = text[:first] + "".join(outside)
        return ParsedToolCalls(content if content.strip() else None, [b.call for b in blocks])

    def call_start(self, text: str) -> int:
        """Where the first call may start (a marker, or the start of one at the very end of
        `text`); len(text) if nowhere."""
        if self.name == "llama3_json":
            body = text.lstrip()
            if body.startswith(PYTHON_TAG):
                body = body[len(PYTHON_TAG):].lstrip()
                return 0 if not body or body.startswith("{") else len(text)
            return 0 if PYTHON_TAG.startswith(body) or body.startswith("{") else len(text)
        markers = (HERMES_START,) if self.name == "hermes" else (DS_CALLS_BEGIN, DS_CALL_BEGIN)
        starts = [text.find(marker) for marker in markers]
        starts += [len(text) - _partial_marker(text, marker) for marker in markers]
        return min([start for start in starts if start >= 0] + [len(text)])

    def closed_calls(self, text: str) -> list[ToolCall]:
        """The calls whose closing marker is in `text` (they cannot change as more text comes);
        none for llama3_json, whose calls are known only at the end."""
        return [block.call for block in self._blocks(text)
                if block.call is not None and block.closed]


@dataclass
class ToolCallStream:
    """One streamed choice: fed the whole text so far each time; says what is new since."""
    parser: ToolCallParser
    content_sent: int = field(default=0, init=False)
    calls_sent: int = field(default=0, init=False)

    def delta(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(new content, new complete tool calls) of the output's text so far."""
        if final:
            parsed = self.parser.parse(text)
            content, calls = parsed.content or "", parsed.tool_calls
        else:
            content, calls = text[:self.parser.call_start(text)], self.parser.closed_calls(text)
            if not content.strip():
                content = ""            # whitespace before calls is no content (see parse)
        new_content, new_calls = content[self.content_sent:], calls[self.calls_sent:]
        self.content_sent = max(self.content_sent, len(content))
        self.calls_sent = max(self.calls_sent, len(calls))
        return new_content, new_calls

"""Tool calling on /v1/chat/completions (docs/tool_calling.md): which tools the template shows the
model, how `tool_choice` constrains the reply, and how the reply becomes `message.tool_calls`.

- `auto` (the default when tools are given, as OpenAI's): the model decides; its text is read by
  the --tool-call-parser (tool_parsers.py) for the format its template taught it. Needs
  --enable-auto-tool-choice and a parser (vLLM's rule: without them it is a 400, not text that
  silently holds an unparsed call).
- `required` and a named function: the reply is constrained by the grammar engine, so it always
  parses whatever the model: `required` to a JSON array of {"name", "parameters"} objects, one of
  the tools each (one item with parallel_tool_calls false); a named function to its arguments
  object. These need no parser.
- `none`: the tools are still shown to the template (vLLM does the same), no call is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from kvserve.server.protocol import ChatCompletionRequest, ChatMessage
from kvserve.server.tool_parsers import ToolCall, ToolCallParser
from kvserve.structured.params import StructuredOutputParams

_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    """How one request's reply is read: `parser` for auto, `forced` for required / a named function."""
    tools: Optional[list[dict[str, Any]]]          # for the chat template (None: no tools)
    parser: Optional[ToolCallParser] = None
    forced: Optional[str] = None                   # "required", or the named function
    constraint: Optional[StructuredOutputParams] = None

    @property
    def reads_calls(self) -> bool:
        return self.parser is not None or self.forced is not None


def tool_mode(req: ChatCompletionRequest, parser_name: Optional[str], auto_enabled: bool) -> ToolMode:
    """The request's tools and choice, checked: a ValueError starting with the field's name."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return ToolMode(None)
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
    names = [tool.function.name for tool in req.tools]
    if len(set(names)) != len(names):
        raise ValueError("tools has two functions of the same name")
    for tool in req.tools:
        if tool.function.parameters is not None and tool.function.parameters.get("type", "object") != "object":
            raise ValueError(f"tools: the parameters of {tool.function.name} must be a JSON schema of type object")
    if choice == "none":
        return ToolMode(tools)
    if choice is None or choice == "auto":
        if not (auto_enabled and parser_name):
            raise ValueError("tool_choice auto needs the server started with --enable-auto-tool-choice and "
                             "--tool-call-parser; use tool_choice required or a named function")
        return ToolMode(tools, parser=ToolCallParser(parser_name))
    if choice == "required":
        items = {"anyOf": [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": tool.function.parameters or _ANY_OBJECT},
            "required": ["name", "parameters"], "additionalProperties": False} for tool in req.tools]}
        schema = {"type": "array", "items": items, "minItems": 1}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolMode(tools, forced="required", constraint=StructuredOutputParams(json=schema, source="tools"))
    named = choice.function.name
    if named not in names:
        raise ValueError(f"tool_choice names {named!r}, which is not one of the tools")
    parameters = req.tools[names.index(named)].function.parameters or _ANY_OBJECT
    return ToolMode(tools, forced=named, constraint=StructuredOutputParams(json=parameters, source="tools"))


def forced_calls(mode: ToolMode, text: str) -> list[ToolCall]:
    """The calls of a reply the grammar constrained (required / a named function). A reply cut at
    max_tokens does not parse, and has no calls."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if mode.forced != "required":
        return [ToolCall(mode.forced, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]


def template_tool_calls(message: ChatMessage) -> Optional[list[dict[str, Any]]]:
    """An assistant message's calls as chat templates read them: the arguments as an object (the
    templates serialise them themselves, so a JSON text would be quoted twice)."""
    if not message.tool_calls:
        return None
    calls = []
    for call in message.tool_calls:
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = call.function.arguments
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls


def openai_tool_calls(calls: list[ToolCall], stream: bool = False, first_index: int = 0) -> list[dict[str, Any]]:
    """OpenAI's message.tool_calls (and, with `stream`, a delta's, each with its index)."""
    rendered = []
    for index, call in enumerate(calls, start=first_index):
        entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        rendered.append({"index": index, **entry} if stream else entry)
    return rendered

"""The request fields that constrain an output (OpenAI's response_format, vLLM's guided_* and
structured_outputs) -> the one StructuredOutputParams the engine compiles. Each constraint keeps
the name of the field it came from, so an error the engine finds when compiling it (an invalid
schema, a regex it cannot compile) is a 400 naming that field."""

from __future__ import annotations

from typing import Any, Optional

from kvserve.structured.params import StructuredOutputParams

GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
          ("guided_grammar", "grammar"))
# The fields a constraint can come from; tool_choice required / a named function constrains the
# reply too (server/tools.py), and its errors name tools or tool_choice.
SOURCES = ("response_format", "structured_outputs", *(name for name, _ in GUIDED), "tools", "tool_choice")


def structured_output_of(req: Any) -> Optional[StructuredOutputParams]:
    """The request's constraint, or None; a ValueError starting with the field's name (a 400 naming
    it, errors.from_value_error) for a malformed one or for two."""
    given: list[tuple[str, dict[str, Any]]] = []
    response_format = req.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        else:
            spec = response_format.json_schema
            if spec is None or spec.json_schema is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            given.append(("response_format", {"json": spec.json_schema}))
    for name, kind in GUIDED:
        value = getattr(req, name)
        if value is not None:
            given.append((name, {kind: value}))
    if req.structured_outputs is not None:
        field = req.structured_outputs
        given.append(("structured_outputs", {"json": field.json_schema, "regex": field.regex, "choice": field.choice,
                                             "grammar": field.grammar, "json_object": bool(field.json_object)}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ValueError(f"{given[1][0]} is a second output constraint: give one, not several ({names})")
    source, fields = given[0]
    return StructuredOutputParams(**fields, source=source)

"""StructuredOutputParams: the one constraint a request puts on its output (vLLM's
`structured_outputs` / `guided_*` fields and OpenAI's `response_format`), checked for shape when it
is made. A leaf: SamplingParams holds it; the grammar engine (grammar.py) compiles it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

# A grammar this large is refused before it is compiled: compiling is CPU time the engine's
# step loop would spend, and no schema a client sends in earnest comes near it.
MAX_GRAMMAR_CHARS = 256 * 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputParams:
    """Exactly one of the constraints. `json` is a JSON schema (a dict, or its JSON text);
    `json_object` any JSON object; `regex` a regular expression the whole output matches;
    `choice` one of the given strings; `grammar` an EBNF grammar (GBNF-style, rule `root`).

    `source` names the request field it came from (response_format, guided_json, ...), so an error
    found when the engine compiles it names that field; `whitespace_flexible` lets JSON carry any
    whitespace between tokens (small models can then loop on newlines; off, as compact JSON)."""

    json: Optional[Union[str, dict[str, Any]]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    source: str = "structured_output"
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.source} needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"{self.source} json must be a JSON schema (an object or its text)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"{self.source} regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"{self.source} grammar must be a string")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{self.source} choice must be a non-empty list of non-empty strings")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{self.source} is {len(self.text)} characters; at most {MAX_GRAMMAR_CHARS} are "
                             f"accepted")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as one string: what the size limit counts."""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return value
        return json.dumps(value, sort_keys=True, ensure_ascii=False)

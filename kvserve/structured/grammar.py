"""The grammar engine behind structured output: xgrammar compiles a constraint
(StructuredOutputParams) against the model's vocabulary once, and a matcher per request walks it
token by token, writing the set of tokens allowed next into a bitmask row (bit t of word t // 32:
token t may follow).

xgrammar rather than llguidance: on the default model's 49k vocabulary and a nested JSON schema,
xgrammar filled a mask in 5 us on average (98 us worst) against llguidance's 171 us (2.8 ms worst),
its compile taking 13 ms against 5 ms (docs/structured_output.md has the comparison). Compiled
grammars are cached by the compiler, so a schema sent again is not compiled again. Imported on the
first structured request, so the engine runs without it."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from kvserve.structured.params import StructuredOutputParams


# xgrammar's messages start with its C++ log prefix: "[16:26:26] /project/cpp/regex_converter.cc:94: ".
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarUnavailable(RuntimeError):
    pass


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise GrammarUnavailable("structured output needs the xgrammar package (pip install xgrammar)") from exc
    return xgrammar


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass
class CompiledGrammar:
    params: StructuredOutputParams
    compiled: Any          # xgrammar.CompiledGrammar


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self._matcher = _xgrammar().GrammarMatcher(compiled.compiled)

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (and no move) if the grammar does not allow it there."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The output is complete: the grammar accepted a stop token, or nothing may follow."""
        return bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (int32, on the host)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


class BatchFiller:
    """Fills the rows of many matchers at once, on xgrammar's thread pool (a step's constrained rows
    are independent). A quarter of the host's cores: the rest run torch and the step loop; on the
    2-core CI machine that is one thread, the serial loop, since its threads there took cores from
    torch's and made a batch-32 step slower (docs/structured_output.md)."""

    def __init__(self, threads: Optional[int] = None) -> None:
        self.threads = threads if threads is not None else max(1, (os.cpu_count() or 1) // 4)
        self._batch = _xgrammar().BatchGrammarMatcher(self.threads) if self.threads > 1 else None

    def fill(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """bitmask[i] <- the tokens matchers[i] allows next."""
        if self._batch is None or len(matchers) == 1:
            for row, matcher in enumerate(matchers):
                matcher.fill_bitmask(bitmask, row)
            return
        self._batch.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; `stop_token_ids` end an output wherever the grammar
    may end (the model's EOS list)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], threads: int = 2) -> None:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads)

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """Raises ValueError starting with the request field the constraint came from."""
        try:
            return CompiledGrammar(params, self._compile(params))
        except ValueError:
            raise
        except Exception as exc:          # xgrammar reports bad input as RuntimeError and its own types
            lines = str(exc).strip().splitlines()
            detail = _LOG_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
            raise ValueError(f"{params.source} is not a valid {_WHAT[params.kind]}: {detail}") from None

    def _compile(self, params: StructuredOutputParams) -> Any:
        compiler = self._compiler
        if params.json_object:
            return compiler.compile_builtin_json_grammar()
        if params.json is not None:
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{params.source} is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"{params.source} must be a JSON schema object")
            return compiler.compile_json_schema(json.dumps(_bound_strings(schema)),
                                                any_whitespace=params.whitespace_flexible,
                                                strict_mode=True)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            # One EBNF alternative per choice; JSON string syntax is EBNF's string literal syntax.
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(params.grammar)


# One JSON string character: anything but a quote, a backslash or a control character, or an escape.
_JSON_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_OWN_SYNTAX = ("pattern", "format", "enum", "const")


def _bound_strings(schema: Any) -> Any:
    """The schema with each length-bounded string (minLength / maxLength, no pattern of its own)
    written as a pattern of that many JSON characters. xgrammar 0.2.9's rule for length-bounded
    strings lets raw control characters in, which is not JSON: on the H200 a random-weight model
    wrote a tab into 12 of 96 outputs of the structured-output bench that way."""
    if isinstance(schema, list):
        return [_bound_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {key: _bound_strings(value) for key, value in schema.items()}
    if (bounded.get("type") == "string" and ("minLength" in bounded or "maxLength" in bounded)
            and not any(key in bounded for key in _OWN_SYNTAX)):
        low, high = bounded.pop("minLength", 0), bounded.pop("maxLength", "")
        bounded["pattern"] = f"^{_JSON_CHAR}{{{low},{high}}}$"
    return bounded


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
         "choice": "choice list", "grammar": "EBNF grammar (rule root)"}

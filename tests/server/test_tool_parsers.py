"""The tool call parsers (kvserve/server/tool_parsers.py) on their own: each format with one call,
several, content around them, none, malformed ones and a hermes call cut at EOS; and streams fed
the text in chunks of every size and in token-like pieces, which must add up to the whole parse."""

from __future__ import annotations

import json
import re

import pytest

from kvserve.server.tool_parsers import (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END,
                                         DS_SEP, TOOL_CALL_PARSERS, ParsedToolCalls, ToolCall,
                                         ToolCallParser, ToolCallStream)

HERMES, LLAMA3, DEEPSEEK = (ToolCallParser(name) for name in TOOL_CALL_PARSERS)


def hermes(name, arguments, close=True):
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n" + ("</tool_call>" if close else "")


def deepseek_v3(name, arguments):
    return (f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{json.dumps(arguments)}\n```"
            f"{DS_CALL_END}")


def deepseek_v31(name, arguments):
    return f"{DS_CALL_BEGIN}{name}{DS_SEP}{json.dumps(arguments)}{DS_CALL_END}"


def section(*calls):
    return DS_CALLS_BEGIN + "".join(calls) + DS_CALLS_END


WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"zone": "東京"})
BAD_HERMES = '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'
BAD_DEEPSEEK = f'{DS_CALL_BEGIN}f{DS_SEP}{{"x": ]{DS_CALL_END}'
TEXT = "the text"                       # as the content: all of the text, unchanged


def calls(*pairs):
    return [ToolCall(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in pairs]


def llama3(name, arguments, key="parameters"):
    return json.dumps({"name": name, key: arguments})


CASES = [    # (parser, text, content, calls)
    (HERMES, hermes(*WEATHER), None, calls(WEATHER)),
    (HERMES, hermes(*WEATHER) + "\n" + hermes(*TIME), None, calls(WEATHER, TIME)),
    (HERMES, "Let me check.\n" + hermes(*WEATHER), "Let me check.\n", calls(WEATHER)),
    (HERMES, "Sure.\n" + hermes(*WEATHER) + "\n" + hermes(*TIME) + "\nDone.", "Sure.\n\nDone.",
     calls(WEATHER, TIME)),                                  # whitespace between calls is dropped
    (HERMES, "It is <b>sunny</b> (a < b).", TEXT, []),
    (HERMES, BAD_HERMES, TEXT, []),
    (HERMES, "A" + BAD_HERMES + hermes(*TIME), "A" + BAD_HERMES, calls(TIME)),  # bad one stays
    (HERMES, "Sure. " + hermes(*WEATHER, close=False), "Sure. ", calls(WEATHER)),  # cut at EOS
    (HERMES, 'Sure. <tool_call>\n{"name": "get_w', TEXT, []),                 # cut mid-JSON
    (HERMES, '<tool_call>{"arguments": {"x": 1}}</tool_call>', TEXT, []),      # no name
    (HERMES, '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', None,
     [ToolCall("f", '"x=1"')]),                                                # not an object
    (HERMES, '<tool_call>{"name": "f"}</tool_call>', None, [ToolCall("f", "{}")]),
    (HERMES, "Half a tag: <tool", TEXT, []),
    (LLAMA3, llama3(*WEATHER), None, calls(WEATHER)),
    (LLAMA3, "\n <|python_tag|>" + llama3(*TIME, key="arguments"), None, calls(TIME)),
    (LLAMA3, llama3(*WEATHER) + "; " + llama3(*TIME) + ";", None, calls(WEATHER, TIME)),
    (LLAMA3, "The weather is {sunny}.", TEXT, []),
    (LLAMA3, '{"name": "f", "parameters": {"x": }', TEXT, []),
    (LLAMA3, '{"city": "Paris"}', TEXT, []),                                   # JSON, not a call
    (LLAMA3, llama3(*WEATHER) + " and more", TEXT, []),
    (LLAMA3, llama3(*WEATHER) + "; {\"x\": 1}", TEXT, []),
    (LLAMA3, "", TEXT, []),
    (DEEPSEEK, section(deepseek_v3(*WEATHER)), None, calls(WEATHER)),
    (DEEPSEEK, section(deepseek_v3(*WEATHER), deepseek_v3(*TIME)), None, calls(WEATHER, TIME)),
    (DEEPSEEK, "Checking.\n\n" + section(deepseek_v3(*WEATHER)), "Checking.\n\n", calls(WEATHER)),
    (DEEPSEEK, section(f"{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{\n  \"x\": [1, 2]\n}}\n```"
                       f"{DS_CALL_END}"), None, [ToolCall("f", '{"x": [1, 2]}')]),
    (DEEPSEEK, section(deepseek_v31(*WEATHER), deepseek_v31(*TIME)), None, calls(WEATHER, TIME)),
    (DEEPSEEK, "Plain <｜answer｜> text.", TEXT, []),
    (DEEPSEEK, section(BAD_DEEPSEEK), TEXT, []),
    (DEEPSEEK, "A" + section(BAD_DEEPSEEK, deepseek_v31(*TIME)), "A" + BAD_DEEPSEEK, calls(TIME)),
    (DEEPSEEK, "Hi" + DS_CALLS_BEGIN + deepseek_v31(*WEATHER)[:-len(DS_CALL_END)], "Hi",
     calls(WEATHER)),                                                          # cut at EOS
    (DEEPSEEK, "Hi" + section(deepseek_v31(*WEATHER)[:-len(DS_CALL_END)]), "Hi", calls(WEATHER)),
    (DEEPSEEK, "Hi " + deepseek_v31(*WEATHER), "Hi ", calls(WEATHER)),         # no section begin
    (DEEPSEEK, section(f"{DS_CALL_BEGIN}{DS_SEP}{{}}{DS_CALL_END}"), TEXT, []),   # no name
    (DEEPSEEK, section(f'{DS_CALL_BEGIN}f{DS_SEP}"x"{DS_CALL_END}'), None, [ToolCall("f", '"x"')]),
]
CASES = [(parser, text, text if content is TEXT else content, expected)
         for parser, text, content, expected in CASES]


@pytest.mark.parametrize("parser,text,content,expected", CASES)
def test_parse(parser, text, content, expected):
    assert parser.parse(text) == ParsedToolCalls(content, expected)


def test_calls_get_fresh_openai_ids_and_unescaped_arguments():
    parsed = HERMES.parse(hermes(*TIME) + hermes(*TIME))
    ids = [call.id for call in parsed.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2
    assert parsed.tool_calls[0].arguments == '{"zone": "東京"}'


@pytest.mark.parametrize("parser,text,start", [
    (HERMES, "abc", 3), (HERMES, "abc<tool_call>x", 3), (HERMES, "abc<tool_c", 3),
    (HERMES, "a<", 1), (HERMES, "a<b", 3), (HERMES, "x</tool_call>", 13),
    (LLAMA3, "", 0), (LLAMA3, "  <|pyth", 0), (LLAMA3, "<|python_tag|> {", 0), (LLAMA3, " {", 0),
    (LLAMA3, "Hi {", 4), (LLAMA3, "<|python_tag|>print(1)", 22),
    (DEEPSEEK, "ab" + DS_CALLS_BEGIN, 2), (DEEPSEEK, "ab" + DS_CALL_BEGIN, 2),
    (DEEPSEEK, "ab" + DS_CALLS_BEGIN[:9], 2), (DEEPSEEK, "ab" + deepseek_v31(*TIME) + DS_CALLS_BEGIN, 2), (DEEPSEEK, "ab<｜end", 7),
])
def test_call_start(parser, text, start):
    assert parser.call_start(text) == start


def test_unknown_parser():
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ToolCallParser("mistral")


MARKERS = ["<tool_call>", "</tool_call>", "<|python_tag|>", DS_CALLS_BEGIN, DS_CALLS_END,
           DS_CALL_BEGIN, DS_CALL_END, DS_SEP]


def pieces(text):
    """Ways a text arrives: chunks of 1 to 7 characters, word-like tokens (markers in bits) and
    markers as single special tokens."""
    for size in range(1, 8):
        yield [text[at:at + size] for at in range(0, len(text), size)]
    yield re.findall(r"\w+|\s+|.", text, re.DOTALL)
    yield [p for p in re.split("(" + "|".join(map(re.escape, MARKERS)) + ")", text) if p]


def stream(parser, chunks):
    """The content and calls a stream sends, and what it had sent before the end."""
    live, text, content, sent = ToolCallStream(parser), "", "", []
    for i, chunk in enumerate(chunks):
        text += chunk
        new_content, new_calls = live.delta(text, final=i == len(chunks) - 1)
        content, sent = content + new_content, sent + new_calls
        if i < len(chunks) - 1:
            held = text[len(content):]
            for marker in MARKERS:     # no piece of a marker has gone out as content
                assert not any(content.endswith(marker[:n]) and held.startswith(marker[n:])
                               for n in range(1, len(marker)))
    return content, sent


@pytest.mark.parametrize("parser,text,content,expected", CASES)
def test_streams_add_up_to_the_parse_whatever_the_chunking(parser, text, content, expected):
    for chunks in pieces(text):
        assert stream(parser, chunks or [""]) == (content or "", expected)


@pytest.mark.parametrize("parser,text,head", [
    (HERMES, "Let me check. " + hermes(*WEATHER) + "\n" + hermes(*TIME, close=False),
     "Let me check. "),
    (DEEPSEEK, "Checking. " + section(deepseek_v3(*WEATHER), deepseek_v31(*TIME)), "Checking. "),
])
def test_a_closed_call_goes_out_before_the_end(parser, text, head):
    call_end = "</tool_call>" if parser is HERMES else DS_CALL_END
    live, first_end = ToolCallStream(parser), text.index(call_end) + len(call_end)
    assert live.delta(text[:first_end - 1], final=False) == (head, [])
    assert live.delta(text[:first_end], final=False) == ("", calls(WEATHER))
    second_open = text.index("get_time") + 20       # inside the second call's arguments
    assert live.delta(text[:second_open], final=False) == ("", [])
    assert live.delta(text, final=True) == ("", calls(TIME))


def test_llama3_json_is_held_until_the_end():
    text = json.dumps({"name": WEATHER[0], "parameters": WEATHER[1]})
    live = ToolCallStream(LLAMA3)
    assert live.delta(text, final=False) == ("", [])
    assert live.delta(text, final=True) == ("", calls(WEATHER))
    plain = ToolCallStream(LLAMA3)
    assert plain.delta("  ", final=False) == ("", [])
    assert plain.delta("  Hi", final=False) == ("  Hi", [])


def test_whitespace_before_calls_is_not_content():
    text = "\n\n" + hermes(*WEATHER)
    assert HERMES.parse(text).content is None
    assert stream(HERMES, list(text)) == ("", calls(WEATHER))
    assert stream(HERMES, ["\n\n", "Hi"]) == ("\n\nHi", [])

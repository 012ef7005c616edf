"""The reasoning parsers (kvserve/server/reasoning.py) on their own: where a think starts and ends,
a think left open at max_tokens, tags split across stream chunks, and the reasoning token count."""

from __future__ import annotations

import pytest

from kvserve.server.reasoning import ReasoningParser, ReasoningStream

R1, QWEN3 = ReasoningParser("deepseek_r1"), ReasoningParser("qwen3")


@pytest.mark.parametrize("parser,text,in_reasoning,expected", [
    (R1, "<think>Let me see.</think>\n\nFour.", True, ("Let me see.", "Four.")),
    (R1, "Let me see.</think>Four.", True, ("Let me see.", "Four.")),        # the template opened it
    (R1, "Let me see, and see", True, ("Let me see, and see", "")),          # cut at max_tokens
    (QWEN3, "<think>hmm</think>Four.", False, ("hmm", "Four.")),
    (QWEN3, "Four.", False, (None, "Four.")),                                # no think: all content
    (QWEN3, "hmm</think>Four.", True, ("hmm", "Four.")),
])
def test_split(parser, text, in_reasoning, expected):
    assert parser.split(text, in_reasoning) == expected


def test_where_a_think_starts():
    assert R1.starts_in_reasoning("<|User|>hi<|Assistant|>")
    assert QWEN3.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.starts_in_reasoning("<think>old</think> answer <|im_start|>assistant\n")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ReasoningParser("o1")


@pytest.mark.parametrize("parser,in_reasoning", [(R1, True), (QWEN3, False)])
def test_streamed_deltas_add_up_to_the_split_whatever_the_chunking(parser, in_reasoning):
    text = "<think>Is it 2+2? Yes: <b>4</b>.</think>\nThe answer is 4."
    whole = parser.split(text, in_reasoning)
    for step in (1, 2, 3, 5, 7):                 # "</think>" arrives in pieces at several offsets
        stream, reasoning, content = ReasoningStream(parser, in_reasoning), "", ""
        for end in list(range(step, len(text), step)) + [len(text)]:
            new_reasoning, new_content = stream.delta(text[:end], final=end == len(text))
            reasoning, content = reasoning + new_reasoning, content + new_content
            assert "</th" not in reasoning + content and "<thi" not in content
        assert (reasoning, content) == whole


def test_reasoning_tokens_count_up_to_the_end_tag():
    tokens = ["<think>", "a", "b", "</th", "ink>", "c", "d"]
    decode = lambda ids: "".join(tokens[i] for i in ids)       # noqa: E731
    assert R1.reasoning_tokens(list(range(7)), decode, True) == 5
    assert R1.reasoning_tokens(list(range(3)), decode, True) == 3          # never closed: all of them
    assert QWEN3.reasoning_tokens([5, 6], decode, False) == 0

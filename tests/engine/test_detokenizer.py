"""Stop strings in the incremental detokenizer (kvserve/engine/detokenizer.py), on the default model's
own tokenizer: the earliest stop in the text wins, whatever the order of the list."""

from __future__ import annotations

import pytest

from conftest import requires_default_model
from kvserve.engine.detokenizer import IncrementalDetokenizer, earliest_stop
from kvserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from kvserve.model.loader import default_model_path, resolve_model
    return resolve_model(default_model_path(), "auto").load_tokenizer()


def _run(tokenizer, text: str, stop: list[str], include: bool = False) -> tuple[str, str | None]:
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=stop,
                                   include_stop_str_in_output=include)
    for token_id in tokenizer(text, add_special_tokens=False)["input_ids"]:
        hit = detok.append(token_id)
        if hit is not None:
            return detok.text, hit
    return detok.text, None


@requires_default_model
def test_one_token_holding_two_stops_cuts_at_the_earlier(tokenizer):
    # '."' is one token of this vocabulary: both stops arrive at once, the '.' first in the text.
    assert [tokenizer.decode([t]) for t in tokenizer('The end." Then', add_special_tokens=False)["input_ids"]] \
        == ["The", " end", '."', " Then"]
    for stop in (['"', "."], [".", '"']):
        text, reason = _run(tokenizer, 'The end." Then', stop)
        assert (text, reason) == ("The end", ".")
        text, reason = _run(tokenizer, 'The end." Then', stop, include=True)
        assert (text, reason) == ("The end.", ".")


@requires_default_model
def test_returned_text_never_holds_a_stop_string(tokenizer):
    sentence = 'She said "yes." Then, after a pause, "no!" and left.'
    stops = ["left", "!", '"', ", "]
    for end in range(1, len(stops) + 1):
        text, reason = _run(tokenizer, sentence, stops[:end])
        assert reason is not None
        assert not any(stop in text for stop in stops[:end]), (text, stops[:end])
        assert sentence.startswith(text + reason)


def test_earliest_stop_prefers_the_first_start_then_the_shortest():
    assert earliest_stop('ab."c', ['"', "."]) == (2, ".")
    assert earliest_stop("xabc", ["abc", "ab", "bc"]) == (1, "ab")
    assert earliest_stop("abc", ["z"]) is None
    assert earliest_stop("a.b.", ["."], start=2) == (3, ".")


def test_empty_stop_string_is_refused_naming_the_field():
    from_value_error = pytest.importorskip("kvserve.server.errors").from_value_error   # the server's 400
    with pytest.raises(ValueError, match="stop must not contain an empty string") as info:
        SamplingParams(stop=["\n", ""])
    error = from_value_error(info.value)
    assert (error.status_code, error.param) == (400, "stop")
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="")

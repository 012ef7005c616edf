"""Incremental detokenization and stop-string matching for one output sequence.

Decoding only a short window of recent tokens keeps each step O(1) in the output length, and
holding back text that ends in an incomplete UTF-8 sequence avoids streaming replacement characters.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self._ids: list[int] = list(prompt_token_ids[-6:])
        # Offsets into _ids: text of [prefix, read) is already emitted; [read, end) is pending.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str | None:
        """Adds a token; returns the stop string if the text now contains one (text is then cut)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new_text = full_text[len(prefix_text):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            # Keep the window short; decoding from a token boundary is exact for BPE tokenizers.
            if self._prefix_offset > 32:
                self._ids = self._ids[self._prefix_offset:]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return self._append_text(new_text)
        return None

    def _append_text(self, new_text: str) -> str | None:
        # Only a match that ends in the new text is new: older text was searched when it arrived.
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += new_text
        match = earliest_stop(self.text, self.stop, search_from)
        if match is None:
            return None
        where, stop = match
        self.text = self.text[: where + len(stop)] if self.include_stop_str_in_output else self.text[:where]
        return stop


def earliest_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """The stop string that occurs first in `text[start:]` and where it starts; of several starting at
    one place, the shortest (it is complete first). The text before the match then holds no stop
    string, which the order of the list cannot promise: with stops `['"', '.']`, the text `x."` must
    be cut at the `.`."""
    best: tuple[int, str] | None = None
    for stop in stops:
        where = text.find(stop, start)
        if where != -1 and (best is None or (where, len(stop)) < (best[0], len(best[1]))):
            best = (where, stop)
    return best

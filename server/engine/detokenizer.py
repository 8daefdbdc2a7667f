"""Incremental detokenization and stop-sequence matching on the generated text."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

_INCOMPLETE = "\ufffd"  # what a decoder prints for a multi-byte character cut in the middle


class IncrementalDetokenizer:
    """Turns tokens into text deltas whose concatenation equals decode(all tokens).

    Decodes a short window (as TGI and vLLM do) so each token costs O(1), and holds text back
    while it ends in U+FFFD: a character split across tokens is emitted whole, once complete.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0  # tokens before this are already emitted

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Text still held back at the end of generation (an incomplete character)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def _decode(self, token_ids: list[int]) -> str:
        text = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text


class StopMatcher:
    """Finds the first stop string in text that grows by deltas, scanning only the new tail."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._longest = max((len(stop) for stop in self._stops), default=0)

    def find(self, text: str, new_from: int) -> int | None:
        """Index in text where a stop string starts, given text[:new_from] was checked before."""
        if not self._stops:
            return None
        start = max(0, new_from - self._longest + 1)
        hits = [index for stop in self._stops if (index := text.find(stop, start)) >= 0]
        return min(hits, default=None)

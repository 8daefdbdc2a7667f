"""Incremental detokenization never emits a broken character and adds up to decode(all)."""

from __future__ import annotations

import copy
import random

import pytest

from kenspec.server.engine.detokenizer import IncrementalDetokenizer, StopMatcher


def deltas(tokenizer, token_ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token) for token in token_ids]
    return [*pieces, detokenizer.flush()]


@pytest.mark.parametrize(
    "text", ["日本語の文章と絵文字 🙂 🚀.", "Café naïve résumé über ångström.", "plain ascii text"]
)
def test_split_multibyte_characters_are_emitted_whole(tiny_target, text: str) -> None:
    tokenizer = tiny_target.tokenizer
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = deltas(tokenizer, token_ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    if not text.isascii():
        # The byte-level vocabulary really splits some characters across tokens, and then the
        # first token of such a character produces no text until the character is complete.
        assert len(token_ids) > len(text.encode("utf-8")) / 4 and "" in pieces[:-1]


def test_concatenated_deltas_equal_decode_on_random_tokens(tiny_target) -> None:
    tokenizer = tiny_target.tokenizer
    rng = random.Random(0)
    for _ in range(50):
        token_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        expected = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert "".join(deltas(tokenizer, token_ids)) == expected


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_backends_decode_serves_only_where_it_is_what_decode_does(
    tiny_target, clean_up: bool
) -> None:
    """A fast tokenizer without clean-up is decoded by its Rust backend directly (the same
    text); one that cleans up spaces goes through transformers' decode."""
    tokenizer = copy.deepcopy(tiny_target.tokenizer)
    tokenizer.clean_up_tokenization_spaces = clean_up
    assert (IncrementalDetokenizer(tokenizer)._backend is None) == clean_up
    rng = random.Random(1)
    for text in ("Hello , world . It 's done !", "a  b\n\tc"):
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert "".join(deltas(tokenizer, token_ids)) == expected
    for _ in range(20):
        token_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        expected = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert "".join(deltas(tokenizer, token_ids)) == expected


@pytest.mark.parametrize(
    ("stops", "text", "checked", "found"),
    [
        ((), "abc", 0, None),
        (("c",), "abc", 0, 2),
        (("bc",), "abc", 2, 1),  # the stop straddles what was checked and the new text
        (("ab",), "abxab", 4, 3),  # already-checked occurrences far back are not rescanned
        (("x", "b"), "abx", 0, 1),  # the earliest of several stops wins
    ],
)
def test_stop_matcher(stops, text, checked, found) -> None:
    assert StopMatcher(stops).find(text, checked) == found

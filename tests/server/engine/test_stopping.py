"""Stops, limits and EOS that land inside an accepted chunk cut the output exactly there."""

from __future__ import annotations

import dataclasses

import pytest

from kenspec.api.outputs import FinishReason
from tests.server.engine.drafts import OracleDraft, generate, reference_greedy

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def prompt_and_reference(tiny_target):
    ids = tiny_target.encode_prompt(PROMPT)
    return ids, reference_greedy(tiny_target, ids, 24)


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 10])
def test_max_new_tokens_inside_an_accepted_chunk(tiny_target, prompt_and_reference, limit) -> None:
    ids, reference = prompt_and_reference
    generation = generate(tiny_target, OracleDraft(reference), ids, max_new_tokens=limit, k=8)
    rounds = list(generation)
    assert generation.output_ids == reference[:limit]
    assert rounds[-1].finish_reason is FinishReason.LENGTH
    usage = rounds[-1].usage
    assert usage.completion_tokens == limit
    assert usage.accepted_tokens <= limit
    assert "".join(r.text for r in rounds) == tiny_target.tokenizer.decode(reference[:limit])


def test_eos_inside_an_accepted_chunk(tiny_target, prompt_and_reference) -> None:
    """An oracle that drafts EOS mid-chunk, followed by more tokens: nothing past EOS is kept."""
    ids, reference = prompt_and_reference
    eos = tiny_target.tokenizer.eos_token_id
    # Declare the 4th greedy token to be EOS: the oracle's 8-token chunk is accepted whole and
    # must be cut right after it.
    target = dataclasses.replace(tiny_target, eos_token_ids=frozenset({reference[3], eos}))
    generation = generate(target, OracleDraft(reference), ids, max_new_tokens=24, k=8)
    rounds = list(generation)
    assert generation.output_ids == reference[:4]
    assert rounds[0].finish_reason is FinishReason.EOS and len(rounds) == 1
    assert rounds[0].usage.completion_tokens == 4
    assert rounds[0].usage.accepted_tokens == 4  # drafted 8, four kept: all of them drafts


def test_ignore_eos_keeps_going(tiny_target, prompt_and_reference) -> None:
    ids, reference = prompt_and_reference
    target = dataclasses.replace(tiny_target, eos_token_ids=frozenset({reference[3]}))
    generation = generate(target, OracleDraft(reference), ids, max_new_tokens=12, ignore_eos=True)
    rounds = list(generation)
    assert generation.output_ids == reference[:12]
    assert rounds[-1].finish_reason is FinishReason.LENGTH


def test_stop_sequence_inside_an_accepted_chunk(tiny_target, prompt_and_reference) -> None:
    ids, reference = prompt_and_reference
    decoder = tiny_target.tokenizer
    full = decoder.decode(reference)
    # A stop string of two whole characters from the middle of the (random-model) output.
    start = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    cut = full.find(stop)
    generation = generate(
        tiny_target, OracleDraft(reference), ids, max_new_tokens=24, k=8, stop=(stop,)
    )
    rounds = list(generation)
    text = "".join(r.text for r in rounds)
    assert rounds[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert text == full[:cut]
    assert stop not in text
    # Tokens end with the one that completed the stop string; none after it is emitted or counted.
    n = len(generation.output_ids)
    assert generation.output_ids == reference[:n]
    assert stop in decoder.decode(reference[:n]) and stop not in decoder.decode(reference[: n - 1])
    assert rounds[-1].usage.completion_tokens == n


def test_earliest_of_several_stops_wins(tiny_target, prompt_and_reference) -> None:
    ids, reference = prompt_and_reference
    full = tiny_target.tokenizer.decode(reference)
    late, early = full[12:14], full[4:6]
    generation = generate(tiny_target, OracleDraft(reference), ids, stop=(late, early), k=8)
    text = "".join(r.text for r in generation)
    assert text == full[: full.find(early)]

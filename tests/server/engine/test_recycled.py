"""Recycled target predictions: the table keeps each pass's computed rows, drafts follow it,
and output stays plain greedy decoding's with it on."""

from __future__ import annotations

import pytest
import torch

from kenspec.api.outputs import BreakerState
from kenspec.server.engine.context_draft import ContextDraft
from kenspec.server.engine.draft_tree import Source
from kenspec.server.engine.pass_logits import Logits, OutputLayer, lazy_logits
from kenspec.server.engine.recycled import RecycledPredictions, _stacked
from kenspec.server.engine.speculative_engine import BreakerSettings
from tests.server.engine.drafts import generate


def row(vocab: int, scores: dict[int, float]) -> torch.Tensor:
    logits = torch.full((vocab,), -30.0)
    for token, score in scores.items():
        logits[token] = score
    return logits


def test_a_row_is_kept_under_the_token_it_follows_best_first_with_probabilities() -> None:
    table = RecycledPredictions(vocab_size=10, width=3)
    logits = row(10, {4: 2.0, 7: 1.0, 2: 0.0})
    table.record([5], [(0, logits)])
    expected = torch.softmax(logits, dim=-1)
    kept = table.next_tokens(5)
    assert [token for token, _ in kept] == [4, 7, 2]
    assert [p for _, p in kept] == pytest.approx([float(expected[t]) for t in (4, 7, 2)])
    assert table.next_tokens(6) == []  # never recorded
    assert table.next_tokens(99) == []  # outside the vocabulary


def test_a_newer_row_for_the_same_token_replaces_the_older() -> None:
    table = RecycledPredictions(vocab_size=10, width=2)
    table.record([5, 5], [(0, row(10, {4: 3.0})), (1, row(10, {8: 3.0}))])
    assert table.next_tokens(5)[0][0] == 8
    table.record([5], [(0, row(10, {1: 3.0}))])
    assert table.next_tokens(5)[0][0] == 1


def test_rows_of_one_product_are_read_in_place_and_give_what_copies_give() -> None:
    """A pass's rows computed in one product are recorded from a view of it (no copy),
    others stacked: the table is the same either way, whichever rows are kept (a token
    outside the vocabulary drops its row from the middle) and wherever the block starts."""
    scores = [row(12, {1 + i: 2.0, 11 - i: 1.0}) for i in range(6)]
    block = torch.stack([row(12, {}), *scores])[1:]  # a view that starts one row in
    for tokens in ([0, 1, 2, 3, 4, 5], [0, 1, 99, 3, 4, 5]):
        viewed, copied = RecycledPredictions(12, width=2), RecycledPredictions(12, width=2)
        viewed.record(tokens, [(i, block[i]) for i in range(6)])
        copied.record(tokens, [(i, scores[i].clone()) for i in range(6)])
        assert [viewed.next_tokens(t) for t in range(12)] == [
            copied.next_tokens(t) for t in range(12)
        ]
        assert viewed.next_tokens(4) == copied.next_tokens(4) and viewed.next_tokens(4)
    assert _stacked([block[i] for i in range(6)]).data_ptr() == block.data_ptr()
    assert torch.equal(_stacked([block[0], block[2]]), block[[0, 2]])


def test_a_chain_follows_the_best_next_token_until_unseen_or_improbable() -> None:
    table = RecycledPredictions(vocab_size=10)
    confident, unsure = {2: 10.0}, {3: 1.0, 9: 0.8}  # p ~ 1, then p = 0.55
    table.record([1, 2], [(0, row(10, confident)), (1, row(10, unsure))])
    tokens, probs = table.chain(1, 5)
    assert tokens == [2, 3]  # then 3 has no recorded row
    assert probs == pytest.approx([1.0, 0.55], abs=1e-2)
    assert table.chain(1, 5, min_prob=0.6) == ([2], pytest.approx([1.0], abs=1e-3))
    assert table.chain(1, 1)[0] == [2]
    assert table.chain(7, 5) == ([], [])


def test_a_tree_takes_recycled_predictions_below_its_nodes_and_not_as_a_chain_too() -> None:
    """In chain mode the table's chain is one of the context draft's chains; in a tree it would
    be the best child of each node a second time, counted as a second source that agrees."""
    table = RecycledPredictions(vocab_size=10)
    table.record([1, 2], [(0, row(10, {2: 10.0})), (1, row(10, {3: 10.0}))])
    chains = ContextDraft(None, recycled=table).start([7, 1]).propose(4)
    assert [(c.tokens, c.source) for c in chains] == [((2, 3), Source("recycled"))]
    tree = ContextDraft(None, recycled=table, branches=5).start([7, 1])
    assert all(c.source.kind != "recycled" for c in tree.propose(4))
    assert tree.expand(1) == [(2, Source("recycled", 9))]  # the same prediction, below the node


def test_only_rows_a_pass_computed_are_recycled() -> None:
    hidden = torch.randn(5, 4)
    head = torch.randn(6, 4)
    (logits,) = lazy_logits(hidden, [(0, 5)], OutputLayer(head, head.t()))
    assert [i for i, _ in logits.computed(5)] == [0]
    logits[1]  # computes rows 1..4 in one block (pass_logits.BLOCK)
    rows = logits.computed(3)
    assert [i for i, _ in rows] == [0, 1, 2]
    assert torch.allclose(rows[2][1], hidden[2] @ head.t(), atol=1e-5)
    assert len(Logits.of(torch.zeros(3, 6)).computed(2)) == 2


def test_serving_fills_the_table_with_the_targets_own_greedy_choices(
    tiny_target, references
) -> None:
    """After a greedy answer, the row kept for its last token is the target's prediction after
    it, and the top entry for every token that occurred once is the token that followed it."""
    table = RecycledPredictions(tiny_target.vocab_size)
    ids, expected = next(iter(references.values()))
    generation = generate(tiny_target, None, ids, max_new_tokens=len(expected), recycled=table)
    list(generation)
    assert generation.output_ids == expected
    sequence = [ids[-1], *expected]
    once = [i for i, t in enumerate(sequence[:-1]) if sequence.count(t) == 1]
    assert once, "the reference should hold tokens that occur once"
    assert all(table.next_tokens(sequence[i])[0][0] == sequence[i + 1] for i in once)


@pytest.mark.parametrize("k", [2, 6])
def test_greedy_output_is_exact_drafting_from_recycled_predictions(
    tiny_target, references, k
) -> None:
    """A shared table, warmed by the earlier prompts: drafts from it are accepted sometimes
    and rejected sometimes, and every output is plain greedy decoding's."""
    table = RecycledPredictions(tiny_target.vocab_size)
    # No context chains (an 8-token match is rare here), no probability cut (the tiny model's
    # distributions are flat): rounds draft from the table.
    draft = ContextDraft(None, min_match=8, max_match=8, recycled=table, recycled_min_prob=0.0)
    counts = {"drafted": 0, "accepted": 0, "recycled": 0}
    for ids, expected in references.values():
        generation = generate(
            tiny_target, draft, ids, max_new_tokens=len(expected), k=k, recycled=table
        )
        rounds = list(generation)
        assert generation.output_ids == expected
        counts["drafted"] += sum(r.drafted for r in rounds)
        counts["accepted"] += sum(r.accepted for r in rounds)
        counts["recycled"] += sum(r.source == "recycled" for r in rounds)
    assert 0 < counts["accepted"] < counts["drafted"]
    assert counts["recycled"] > 0  # rounds really drafted from the table


class BrokenTable(RecycledPredictions):
    def chain(self, last_token, k, min_prob=0.0):  # type: ignore[no-untyped-def]
        raise RuntimeError("corrupt table")


def test_a_table_that_raises_trips_the_draft_fault_breaker(tiny_target, references) -> None:
    table = BrokenTable(tiny_target.vocab_size)
    ids, expected = next(iter(references.values()))
    generation = generate(
        tiny_target,
        ContextDraft(None, recycled=table, recycled_min_prob=0.0),
        ids,
        max_new_tokens=len(expected),
        breaker=BreakerSettings(fault_max=2),
        recycled=table,
    )
    assert [t for r in generation for t in r.token_ids] == expected  # decoded plainly instead
    assert generation.engine.draft_breaker_state is BreakerState.OPEN

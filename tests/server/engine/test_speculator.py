"""The speculator weighs a draft's alternative chains by their sources' measured acceptance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from kenspec.server.engine.draft import Candidates, Chain, DraftSession
from kenspec.server.engine.draft_tree import DraftTree, Source
from kenspec.server.engine.params import SpeculationParams
from kenspec.server.engine.speculator import (
    BUSHY_TREE_NODES,
    FORCED,
    PROBE_AFTER,
    REST_AFTER,
    REST_EVERY,
    AcceptanceStats,
    Proposal,
    Speculator,
)

A, B = Source("a"), Source("b")


class TwoSources(DraftSession):
    """Proposes a chain from source "a", then one from source "b"."""

    def propose(self, k: int) -> Candidates:
        return (Chain((1,) * k, (1.0,) * k, A), Chain((2,) * k, (1.0,) * k, B))

    def extend(self, token_ids: Sequence[int]) -> None:
        pass


def speculator(shared: AcceptanceStats) -> Speculator:
    params = SpeculationParams(num_draft_tokens=4, adaptive=False)
    return Speculator(TwoSources(), params, shared=shared)


def test_unmeasured_sources_keep_the_drafts_own_order() -> None:
    assert speculator(AcceptanceStats()).propose(limit=10).tree.sources[0] == (Source("a"),)


def test_the_source_accepted_more_wins_and_is_what_acceptance_is_recorded_for() -> None:
    shared = AcceptanceStats()
    for _ in range(20):
        shared.observe((A, False), drafted=4, accepted=0)
        shared.observe((B, False), drafted=4, accepted=4)
    chosen = speculator(shared)
    proposal = chosen.propose(limit=10)
    assert proposal.tree.sources[0] == (Source("b"),) and proposal.tree.tokens == (2, 2, 2, 2)
    assert proposal.learned == B and proposal.source == "b"
    assert chosen.acceptance_estimate(proposal) > 0.8  # the estimate is b's, the chosen chain's
    # A shorter alternative loses to a longer chain of the same measured acceptance.
    assert (
        max(
            (Chain((1,) * 4, source=B), Chain((1,), source=B)),
            key=chosen._expected_accepted,
        ).tokens
        == (1,) * 4
    )


class LongMatch(DraftSession):
    """A chain longer than k, as a long exact match drafts."""

    def propose(self, k: int) -> Candidates:
        return (Chain(tuple(range(10, 10 + 3 * k)), (1.0,) * (3 * k), Source("suffix", 16)),)

    def extend(self, token_ids: Sequence[int]) -> None:
        pass


def test_a_chain_past_k_is_kept_up_to_the_limit_and_never_past_it() -> None:
    params = SpeculationParams(chain_tokens=4)
    chosen = Speculator(LongMatch(), params)
    assert chosen.propose(limit=10).tree.tokens == tuple(range(10, 20))  # 12 proposed, 10 left
    assert chosen.propose(limit=30).tree.tokens == tuple(range(10, 22))
    assert chosen.propose(limit=3).tree.tokens == (10, 11, 12)


def test_num_draft_tokens_caps_a_long_match_and_k() -> None:
    """The cap is on the round's draft tokens, whatever drafted them: a long match's chain is
    cut to it, and k never exceeds it."""
    capped = Speculator(LongMatch(), SpeculationParams(num_draft_tokens=5, chain_tokens=4))
    assert capped.propose(limit=30).tree.tokens == tuple(range(10, 15))  # 12 proposed, cap 5
    assert Speculator(LongMatch(), SpeculationParams(num_draft_tokens=3)).k == 3


class Forked(DraftSession):
    """Two chains that share their first token, for a token tree."""

    def propose(self, k: int) -> Candidates:
        return (Chain((1, 2, 3, 4), (1.0,) * 4, A), Chain((1, 5, 6), (1.0,) * 3, B))

    def extend(self, token_ids: Sequence[int]) -> None:
        pass


def test_a_tree_holds_at_most_num_draft_tokens_nodes() -> None:
    budget = Speculator(Forked(), SpeculationParams(), tree_budget=16).propose(limit=30).tree
    assert len(budget) == 6 and not budget.is_chain and budget.sources[0] == (A, B)
    capped = Speculator(Forked(), SpeculationParams(num_draft_tokens=4), tree_budget=16)
    assert capped.propose(limit=30).tree == budget.prefix(4)  # the best 4 of the same tree
    shallow = Speculator(Forked(), SpeculationParams(), tree_budget=16).propose(limit=2).tree
    assert max(shallow.depths()) == 2 and len(shallow) == 3  # 1, then 2 and 5


class Guesses(DraftSession):
    """Three chains of 9 tokens branching at the root, and, when `long`, a long match."""

    def __init__(self, long: int = 0) -> None:
        self.long = long

    def propose(self, k: int) -> Candidates:
        chains = tuple(
            Chain(tuple(range(first, first + 9)), (1.0,) * 9, A) for first in (10, 30, 50)
        )
        match = Chain(tuple(range(200, 200 + self.long)), (1.0,) * self.long, B)
        return chains + ((match,) if self.long else ())

    def extend(self, token_ids: Sequence[int]) -> None:
        pass


def test_a_tree_of_guesses_stays_bushy_sized_and_a_long_match_takes_the_budget() -> None:
    """Without a chain longer than BUSHY_TREE_NODES a tree keeps that many nodes whatever the
    budget (27 proposed); a long match raises that to its length, within the budget; a
    smaller budget is kept."""
    shared = AcceptanceStats()
    for _ in range(50):  # sure sources: every proposed node is worth a place
        shared.observe((A, False), drafted=4, accepted=4)
        shared.observe((B, False), drafted=4, accepted=4)
    params = SpeculationParams(num_draft_tokens=16)

    def tree(session: DraftSession, budget: int) -> DraftTree:
        speculator = Speculator(session, params, shared=shared, tree_budget=budget)
        return speculator.propose(limit=30).tree

    assert len(tree(Guesses(), 16)) == BUSHY_TREE_NODES < 16
    assert len(tree(Guesses(long=14), 16)) == 14  # the match's length
    assert len(tree(Guesses(long=20), 16)) == 16  # within the budget
    assert len(tree(Guesses(), 6)) == len(tree(Guesses(long=14), 6)) == 6


def test_a_proposal_holds_its_drafts_gains_and_source_and_is_cut_as_a_value() -> None:
    """Forced tokens first, then the learned ones: a cut keeps the first drafts, forced first,
    and says "grammar" when only forced ones are left."""
    forced = DraftTree.chain((7, 8), (1.0, 1.0), FORCED)
    tree = DraftTree.chain((9, 10), (0.5, 0.25), A).after(forced)
    proposal = Proposal.of(tree, forced=2, learned=A)
    assert proposal.gains == [1.0, 1.0, 0.5, 0.25] and proposal.source == "a"
    assert replace(proposal, probe=True).gains == [1.0] * 4  # a probe: every draft 1.0
    three = proposal.cut(3)
    assert three.tree.tokens == (7, 8, 9) and three.forced == 2 and three.proposed == 4
    assert three.gains == [1.0, 1.0, 0.5] and three.learned_tree.tokens == (9,)
    assert proposal.cut(1).forced == 1 and proposal.cut(1).source == "grammar"
    assert proposal.cut(0).tree == DraftTree() and proposal.cut(0).forced == 0
    assert proposal.tree.tokens == (7, 8, 9, 10)  # cutting made new values
    with pytest.raises(ValueError, match="forced <= nodes"):
        Proposal.of(tree, forced=5)


class Switching(DraftSession):
    """Proposes a chain of four tokens from `source`, settable between rounds."""

    def __init__(self) -> None:
        self.source = A

    def propose(self, k: int) -> Candidates:
        return (Chain((1,) * 4, (1.0,) * 4, self.source),)

    def extend(self, token_ids: Sequence[int]) -> None:
        pass


def test_record_learns_from_the_proposal_it_is_handed_whatever_was_proposed_since() -> None:
    shared = AcceptanceStats()
    session = Switching()
    params = SpeculationParams(num_draft_tokens=4, adaptive=False)
    speculator = Speculator(session, params, shared=shared)
    first = speculator.propose(limit=10)
    session.source = B
    second = speculator.propose(limit=10)  # proposed again before the first is recorded
    assert (first.source, second.source) == ("a", "b")
    speculator.record(first.cut(3), 3)  # a batch kept 3 of the first's drafts: all accepted
    assert shared.counts((A, False)) == (3.0, 3.0) and shared.counts((B, False)) == (0.0, 0.0)
    speculator.record(second, 0)  # the second, uncut: its first draft rejected
    assert shared.counts((B, False)) == (0.0, 1.0) and shared.counts((A, False)) == (3.0, 3.0)


def test_a_starved_request_drafts_one_round_in_rest_every_until_a_draft_is_kept() -> None:
    """Drafts the batch cuts REST_AFTER rounds in a row: the request then drafts only every
    REST_EVERY-th round (its rests keep it starved); once a draft is kept, every round again."""
    speculator = Speculator(Switching(), SpeculationParams(num_draft_tokens=4))
    proposals = []
    for _ in range(REST_AFTER + 2 * REST_EVERY):
        proposals.append(proposal := speculator.propose(limit=10))
        speculator.record(proposal.cut(0), 0)
    drafted = [bool(proposal.tree) for proposal in proposals]
    rests = [False] * (REST_EVERY - 1) + [True]
    assert drafted == [True] * REST_AFTER + rests + rests
    speculator.record(speculator.propose(limit=10), 0)  # a rest round
    speculator.record(speculator.propose(limit=10), 0)
    speculator.record(speculator.propose(limit=10), 0)
    kept = speculator.propose(limit=10)
    assert kept.tree
    speculator.record(kept.cut(2), 1)  # kept by the batch: no longer starved
    assert all(speculator.propose(limit=10).tree for _ in range(REST_EVERY))


def test_proposing_leaves_nothing_a_round_must_call_in_order() -> None:
    """Proposals of the same state are equal whatever came between; a starved round counts
    when recorded, with the cut its proposal carries."""
    speculator = Speculator(Switching(), SpeculationParams(num_draft_tokens=4))
    first = speculator.propose(limit=10)
    assert speculator.propose(limit=10) == first and first.gains == speculator.propose(10).gains
    drafted = 0
    while not (probe := speculator.propose(limit=10)).probe:
        drafted += bool(probe.tree)
        speculator.record(probe.cut(0), 0)  # every draft cut
        assert drafted <= PROBE_AFTER
    assert drafted == PROBE_AFTER  # starved rounds count the drafts cut, not the rests
    assert probe.probe and probe.gains == [1.0] * 4
    assert not first.probe and first.gains != probe.gains  # an earlier value is unchanged

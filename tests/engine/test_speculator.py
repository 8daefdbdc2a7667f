"""The speculator weighs a draft's alternative chains by their sources' measured acceptance."""

from __future__ import annotations

from server.engine.draft import Proposal
from server.engine.draft_tree import Source
from server.engine.params import SpeculationParams
from server.engine.speculator import AcceptanceStats, Speculator


class TwoSources:
    """Proposes a chain from source "a", with one from source "b" as its alternative."""

    def propose(self, k: int) -> Proposal:
        b = Proposal((2,) * k, (1.0,) * k, source="b")
        return Proposal((1,) * k, (1.0,) * k, source="a", alternatives=(b,))

    def extend(self, token_ids) -> None:  # type: ignore[no-untyped-def]
        pass


def speculator(shared: AcceptanceStats) -> Speculator:
    params = SpeculationParams(num_draft_tokens=4, adaptive=False)
    return Speculator(TwoSources(), params, shared=shared)


def test_unmeasured_sources_keep_the_drafts_own_order() -> None:
    assert speculator(AcceptanceStats()).propose(limit=10).sources[0] == (Source("a"),)


def test_the_source_accepted_more_wins_and_is_what_acceptance_is_recorded_for() -> None:
    shared = AcceptanceStats()
    for _ in range(20):
        shared.observe(("a", False), drafted=4, accepted=0)
        shared.observe(("b", False), drafted=4, accepted=4)
    chosen = speculator(shared)
    proposal = chosen.propose(limit=10)
    assert proposal.sources[0] == (Source("b"),) and proposal.tokens == (2, 2, 2, 2)
    assert chosen.acceptance_estimate() > 0.8  # the estimate is b's, the chosen chain's
    # A shorter alternative loses to a longer chain of the same measured acceptance.
    assert (
        max(
            (Proposal((1,) * 4, source="b"), Proposal((1,), source="b")),
            key=chosen._expected_accepted,
        ).token_ids
        == (1,) * 4
    )


class LongMatch:
    """A chain longer than k, as a long exact match drafts."""

    def propose(self, k: int) -> Proposal:
        return Proposal(tuple(range(10, 10 + 3 * k)), (1.0,) * (3 * k), source="suffix:16")

    def extend(self, token_ids) -> None:  # type: ignore[no-untyped-def]
        pass


def test_a_chain_past_k_is_kept_up_to_the_limit_and_never_past_it() -> None:
    params = SpeculationParams(num_draft_tokens=4, adaptive=False)
    chosen = Speculator(LongMatch(), params)
    assert chosen.propose(limit=10).tokens == tuple(range(10, 20))  # 12 proposed, 10 left
    assert chosen.propose(limit=30).tokens == tuple(range(10, 22))
    assert chosen.propose(limit=3).tokens == (10, 11, 12)

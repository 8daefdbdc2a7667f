"""Nothing one tenant's requests teach the engine reaches another's drafts: recycled
predictions and acceptance statistics are per tenant, so a second tenant after the first
tenant's repeats drafts exactly as on a fresh server (server.engine.tenant_state)."""

from __future__ import annotations

import pytest

from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.engine.recycled import RecycledPredictions
from kenspec.server.engine.speculative_engine import ContextSettings, SpeculativeEngine
from kenspec.server.engine.tenant_index import SHARED_TENANT, TenantSuffixIndex
from kenspec.server.engine.tenant_state import TenantStates

NEW_TOKENS = 24


def engine(target, *, isolate: bool = True, max_tenants: int = 16) -> SpeculativeEngine:
    """Context drafts with a suffix index, recycled predictions and token trees, as served
    (no cost model: every round verifies what it drafted, so the counts are deterministic)."""
    return SpeculativeEngine(
        target,
        None,
        context=ContextSettings(enabled=True, min_match=1, max_match=8, tree_budget=8),
        suffix=TenantSuffixIndex(),
        recycled=RecycledPredictions(target.vocab_size),
        isolate_tenants=isolate,
        max_tenants=max_tenants,
    )


def serve(served: SpeculativeEngine, ids: list[int], tenant: str) -> list[tuple[int, int]]:
    """(drafted, accepted) of each round of a greedy answer to `ids` for `tenant`."""
    generation = served.start(
        ids,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
        speculation=SpeculationParams(num_draft_tokens=8, adaptive=False),
        tenant=tenant,
    )
    return [(r.drafted, r.accepted) for r in served.batch.rounds(generation)]


def accepted(rounds: list[tuple[int, int]]) -> int:
    return sum(accepted for _, accepted in rounds)


@pytest.mark.parametrize("tenant_b", ["b", SHARED_TENANT])
def test_a_second_tenant_after_the_firsts_repeats_drafts_as_on_a_fresh_server(
    tiny_target, references, tenant_b
) -> None:
    """Tenant a asks each prompt three times, then b asks it once: b's rounds (drafted and
    accepted, round by round) are those of b alone on a fresh engine."""
    after_a, fresh = engine(tiny_target), engine(tiny_target)
    for ids, _ in references.values():
        for _ in range(3):
            serve(after_a, ids, "a")
        assert serve(after_a, ids, tenant_b) == serve(fresh, ids, tenant_b)


def test_the_shared_scope_lets_the_second_caller_learn_from_the_first(
    tiny_target, references
) -> None:
    """The control: with one scope for everyone (--suffix-index-scope shared) the same
    sequence does change b's drafts, so the isolated test above could see a leak."""
    after_a, fresh = engine(tiny_target, isolate=False), engine(tiny_target, isolate=False)
    gained = 0
    for ids, _ in references.values():
        for _ in range(3):
            serve(after_a, ids, "a")
        gained += accepted(serve(after_a, ids, "b")) - accepted(serve(fresh, ids, "b"))
    assert gained > 0


def test_a_tenants_own_repeats_still_teach_its_drafts(tiny_target, references) -> None:
    served, fresh = engine(tiny_target), engine(tiny_target)
    ids, _ = next(iter(references.values()))
    serve(served, ids, "a")
    assert accepted(serve(served, ids, "a")) > accepted(serve(fresh, ids, "a"))


def test_tenant_states_keep_the_most_recent_tenants_and_make_fresh_ones() -> None:
    made: list[RecycledPredictions] = []

    def new_table() -> RecycledPredictions:
        made.append(RecycledPredictions(16))
        return made[-1]

    states = TenantStates(new_table, max_tenants=2)
    a = states.of("a")
    assert states.of("a") is a and len(made) == 1
    b = states.of("b")
    assert b.recycled is not a.recycled and b.acceptance is not a.acceptance
    states.of("a")  # a is now the most recent: c's arrival drops b
    states.of("c")
    assert "a" in states and "b" not in states and len(states) == 2
    assert states.of("b").recycled is not b.recycled  # back, from nothing
    states.forget("b")
    assert "b" not in states
    with pytest.raises(ValueError, match="max_tenants"):
        TenantStates(None, max_tenants=0)
    assert TenantStates(None, max_tenants=1).of("a").recycled is None

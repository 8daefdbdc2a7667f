"""Isolation between callers: each tenant drafts from the seeded corpus and its own answers
only, a tenant's flood evicts only its own oldest answers, and the bound holds in all."""

from __future__ import annotations

import pytest

from kenspec.server.engine.intake import BatchSettings
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.engine.speculative_engine import ContextSettings, SpeculativeEngine
from kenspec.server.engine.suffix_index import SuffixIndex, propose_across
from kenspec.server.engine.tenant_index import SHARED_TENANT, TenantSuffixIndex, _segment_tokens

SEEDED = [10, 11, 12, 13, 14, 15]  # the corpus: [10, 11] -> 12 13 14 15
A_ANSWER = [40, 41, 42, 43, 44]
B_ANSWER = [60, 61, 62, 63, 64]


def seeded_index(**options: int) -> TenantSuffixIndex:
    corpus = SuffixIndex(max_tokens=options.get("max_tokens", 1000))
    corpus.add(SEEDED)
    return TenantSuffixIndex(corpus, **options)


@pytest.mark.parametrize(
    ("learner", "asker", "context", "expected"),
    [
        ("a", "a", [40, 41], ([42, 43, 44], 2)),  # its own answer
        ("a", "b", [40, 41], ([], 0)),  # another tenant's: never
        ("a", SHARED_TENANT, [40, 41], ([], 0)),  # the shared tenant is a tenant like any
        ("a", "b", [10, 11], ([12, 13, 14, 15], 2)),  # the corpus: every tenant's
        ("a", "a", [10, 11], ([12, 13, 14, 15], 2)),
    ],
)
def test_a_tenant_drafts_from_the_corpus_and_its_own_answers_only(
    learner, asker, context, expected
) -> None:
    index = seeded_index()
    index.add(learner, A_ANSWER)
    assert index.view(asker).propose(context, 4) == expected


def test_a_view_sees_answers_learned_after_it_was_taken() -> None:
    index = seeded_index()
    view = index.view("a")  # a stream starts before its tenant's first answer finishes
    index.add("a", A_ANSWER)
    assert view.propose([40, 41], 3) == ([42, 43, 44], 2)


@pytest.mark.parametrize(
    ("indices", "context", "expected"),
    [
        # The longest match wins whichever index holds it.
        (([1, 2, 3, 4, 5], [9, 3, 4, 7]), [1, 2, 3, 4], ([5], 4)),
        (([9, 3, 4, 7], [1, 2, 3, 4, 5]), [1, 2, 3, 4], ([5], 4)),
        # Equally long: one vote over both; a tie goes to the later (newer) index.
        (([3, 4, 5], [3, 4, 6]), [3, 4], ([6], 2)),
        (([3, 4, 5], [3, 4, 6], [3, 4, 5]), [3, 4], ([5], 2)),
        (([1, 2, 3], []), [7, 8], ([], 0)),
    ],
)
def test_propose_across_indices_is_one_index_over_all(indices, context, expected) -> None:
    built = []
    for answer in indices:
        index = SuffixIndex()
        if answer:
            index.add(answer)
        built.append(index)
    assert propose_across(built, context, 1) == expected


def flood(index: TenantSuffixIndex, tenant: str, answers: int, start: int = 1000) -> None:
    for number in range(answers):  # 9-token answers, 10 ids with the separator
        first = start + 10 * number
        index.add(tenant, list(range(first, first + 9)))


@pytest.mark.parametrize("answers", [1, 10, 100, 1000])
def test_a_flood_evicts_only_the_flooders_own_oldest_answers(answers) -> None:
    index = seeded_index(max_tokens=200)
    index.add("b", B_ANSWER)
    index.add("a", A_ANSWER)
    flood(index, "a", answers)
    assert index.tokens <= 200
    assert index.view("b").propose([10, 11], 4) == ([12, 13, 14, 15], 2)  # the corpus
    assert index.view("c").propose([10, 11], 4) == ([12, 13, 14, 15], 2)
    assert index.view("b").propose([60, 61], 3) == ([62, 63, 64], 2)  # b's own, intact
    last = 1000 + 10 * (answers - 1)
    assert index.view("a").propose([last, last + 1], 2) == ([last + 2, last + 3], 2)
    learned_a = index.learned("a")
    assert learned_a is not None and learned_a.tokens <= index.share(2)
    if answers >= 100:  # a's share is 93 ids: its first answers are gone
        assert index.view("a").propose([40, 41], 3) == ([], 0)


@pytest.mark.parametrize(
    ("tenants", "max_tenants", "kept"),
    [
        (["a", "b", "c"], 3, ["a", "b", "c"]),
        (["a", "b", "c"], 2, ["b", "c"]),  # the least recently used went
        (["a", "b", "a", "c"], 2, ["a", "c"]),  # a learned again: b was the least recent
        (["a", "b", "view:a", "c"], 2, ["a", "c"]),  # drafting is a use too
        (["a", "a", "a"], 1, ["a"]),
    ],
)
def test_at_most_max_tenants_are_kept_least_recently_used_dropped(
    tenants, max_tenants, kept
) -> None:
    index = seeded_index(max_tokens=1000, max_tenants=max_tenants)
    for number, tenant in enumerate(tenants):
        if tenant.startswith("view:"):
            index.view(tenant.removeprefix("view:"))
        else:
            index.add(tenant, [100 * number + offset for offset in range(5)])
    assert sorted(index.tenants) == kept


@pytest.mark.parametrize(
    ("max_tokens", "tenants", "answers"),
    [(200, 1, 50), (200, 2, 50), (200, 5, 30), (1000, 16, 40), (50, 3, 10), (8, 2, 4)],
)
def test_the_bound_holds_the_corpus_included_and_shares_are_even(
    max_tokens, tenants, answers
) -> None:
    """Tenants arriving one after another, each flooding: the corpus (7 ids) stays, and the
    corpus plus every tenant's answers never exceed the bound."""
    index = seeded_index(max_tokens=max_tokens)
    assert index.learned_budget == max(0, max_tokens - 7)
    for number in range(tenants):
        flood(index, f"t{number}", answers, start=10_000 * (number + 1))
        assert index.tokens <= max(max_tokens, 7)
        for tenant in index.tenants:
            learned = index.learned(tenant)
            assert learned is not None and learned.tokens <= index.share(len(index.tenants))
    assert index.seeded.tokens == 7
    assert index.view("x").propose([10, 11], 4) == ([12, 13, 14, 15], 2)


def test_a_corpus_that_fills_the_bound_leaves_nothing_to_learn() -> None:
    index = seeded_index(max_tokens=7)
    index.add("a", A_ANSWER)
    assert (index.learned_budget, index.tenants, index.tokens) == (0, [], 7)


def test_shrinking_an_index_drops_its_oldest_segments() -> None:
    index = SuffixIndex(max_tokens=100, segment_tokens=10)
    for start in range(100, 180, 8):  # ten 4-token answers, 5 ids each
        index.add([start, start + 1, start + 2, start + 3])
    index.bound(12, 6)
    assert index.tokens <= 12 and index.segment_tokens == 6
    assert index.propose([100, 101], 1) == ([], 0)
    assert index.propose([172, 173], 1) == ([174], 2)
    index.bound(0)
    assert index.tokens == 0 and index.propose([172, 173], 1) == ([], 0)


def engine(tiny_target, *, isolate: bool, prefix_cache: int = 0) -> SpeculativeEngine:
    return SpeculativeEngine(
        tiny_target,
        None,
        context=ContextSettings(enabled=True, min_match=1, max_match=8),
        batching=BatchSettings(prefix_cache_bytes=prefix_cache),
        suffix=TenantSuffixIndex(),
        isolate_tenants=isolate,
    )


def serve(engine: SpeculativeEngine, ids: list[int], tenant: str, max_new: int = 24) -> list:
    generation = engine.start(
        ids,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new, ignore_eos=True),
        speculation=SpeculationParams(num_draft_tokens=4, adaptive=False),
        tenant=tenant,
    )
    return list(engine.batch.rounds(generation))


@pytest.mark.parametrize(
    ("isolate", "second", "from_index"),
    [(True, "a", True), (True, "b", False), (False, "b", True)],
)
def test_a_second_tenant_drafts_nothing_from_the_firsts_answer(
    tiny_target, references, isolate, second, from_index
) -> None:
    """Tenant a is served a prompt; the same prompt from `second` drafts a's answer from the
    index only if it is a's own request, or the scope is shared (isolate off)."""
    served = engine(tiny_target, isolate=isolate)
    ids, _ = next(iter(references.values()))
    serve(served, ids, "a")
    rounds = serve(served, ids, second)
    sources = {r.source.split(":")[0] for r in rounds if r.drafted}
    assert ("suffix" in sources) is from_index, sources
    learners = sorted({"a", second}) if isolate else [SHARED_TENANT]
    assert served.suffix is not None and sorted(served.suffix.tenants) == learners


@pytest.mark.parametrize(
    ("isolate", "second", "reused"), [(True, "a", True), (True, "b", False), (False, "b", True)]
)
def test_a_prompt_reuses_only_its_own_tenants_cached_prefixes(
    tiny_target, references, isolate, second, reused
) -> None:
    served = engine(tiny_target, isolate=isolate, prefix_cache=1 << 20)
    ids, _ = next(iter(references.values()))
    serve(served, ids, "a", max_new=4)
    before = served.batch.stats.reused_tokens
    serve(served, ids, second, max_new=4)
    assert (served.batch.stats.reused_tokens > before) is reused


@pytest.mark.parametrize(
    ("share", "segment"),
    [(0, 1), (100, 100), (2_048, 2_048), (10_000, 2_048), (50_000, 6_250), (10**7, 65_536)],
)
def test_a_tenants_segments_are_an_eighth_of_its_share_within_limits(share, segment) -> None:
    assert _segment_tokens(share) == segment

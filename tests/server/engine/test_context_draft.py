"""Context drafting: the longest earlier match of the suffix, updated incrementally, combined."""

from __future__ import annotations

import collections
import random

import pytest

from kenspec.server.engine.context_draft import ContextDraft, ContextIndex
from kenspec.server.engine.draft_tree import Source
from kenspec.server.engine.suffix_index import SuffixIndex
from kenspec.server.engine.tenant_index import TenantSuffixIndex
from tests.server.engine.drafts import FixedDraft


def brute_force_continuation(
    tokens: list[int], k: int, low: int, high: int
) -> tuple[list[int], int]:
    """Longest suffix of length in [low, high] seen earlier; its most recent earlier start."""
    end = len(tokens)
    for n in range(min(high, end), low - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):  # occurrences ending before the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k], n
    return [], 0


def test_index_agrees_with_brute_force_as_tokens_arrive() -> None:
    rng = random.Random(3)
    index = ContextIndex(min_match=2, max_match=5)
    tokens: list[int] = []
    for _ in range(400):
        chunk = [rng.randrange(6) for _ in range(rng.randint(1, 3))]
        index.extend(chunk)
        tokens.extend(chunk)
        assert index.continuation(4) == brute_force_continuation(tokens, 4, 2, 5)


def test_context_alone_copies_what_followed_the_match() -> None:
    draft = ContextDraft(None, min_match=2, max_match=4, long_draft_tokens=0)
    session = draft.start([10, 11, 12, 13, 14, 99, 10, 11])
    assert session.propose(3)[0].tokens == (12, 13, 14)
    session.extend([12, 13])
    assert session.propose(2)[0].tokens == (14, 99)
    session.extend([50, 51])  # never seen: no proposal
    assert session.propose(4)[0].tokens == ()


def test_static_draft_when_no_match_and_to_continue_a_short_match() -> None:
    static = FixedDraft([7, 7, 7, 7])
    draft = ContextDraft(static, min_match=2, max_match=4)
    assert draft.start([1, 2, 3]).propose(3)[0].tokens == (7, 7, 7)  # no match: the n-gram
    session = draft.start([5, 6, 8, 5, 6])
    assert session.propose(2)[0].tokens == (8, 5)  # matched: context first
    with pytest.raises(ValueError, match="min_match"):
        ContextDraft(None, min_match=4, max_match=2)


def test_proposals_say_where_they_came_from_by_match_length() -> None:
    """The batch's width choice tracks acceptance per source; match length predicts it."""
    draft = ContextDraft(FixedDraft([7, 7], source="static"), min_match=1, max_match=8)
    assert draft.start([1, 2, 3]).propose(2)[0].source == Source(
        "static"
    )  # no match: the static draft
    assert draft.start([1, 2, 9, 2]).propose(2)[0].source == Source("context", 1)
    assert draft.start([1, 2, 9, 1, 2]).propose(2)[0].source == Source("context", 2)
    assert draft.start([4, 1, 2, 3, 9, 4, 1, 2, 3]).propose(2)[0].source == Source("context", 4)
    assert draft.start([5, 4, 1, 2, 3, 9, 5, 4, 1, 2, 3]).propose(2)[0].source == Source(
        "context", 5
    )


def test_copies_are_the_matched_chains_at_least_as_long_as_asked() -> None:
    """An open breaker's drafts: exact matches only, never the static draft's guesses."""
    draft = ContextDraft(FixedDraft([7, 7, 7], source="static"), min_match=1, max_match=8)
    session = draft.start([4, 1, 2, 3, 9, 8, 4, 1, 2, 3])  # [4, 1, 2, 3] matched: 9, 8 follow
    (copy,) = session.copies(2, 4)
    assert copy.tokens[:2] == (9, 8) and copy.source == Source("context", 4)
    assert session.copies(2, 5) == ()  # the match is 4 tokens long
    assert draft.start([1, 2, 3]).copies(2, 1) == ()  # no match: no copy, not the n-gram
    assert FixedDraft([7]).start([1]).copies(2, 1) == ()  # a session without matches


def test_may_copy_is_true_wherever_a_copy_is_found_and_false_where_none_may_be() -> None:
    """The cheap check before a copy is built (every round of an open breaker): never
    False where `copies` finds one (own context or past answers, through a tenant's view too),
    and False at most positions of a stream whose 4-grams are new."""
    rng = random.Random(7)
    answers = [[rng.randrange(6) for _ in range(40)] for _ in range(30)]
    indexes = TenantSuffixIndex(SuffixIndex())
    for answer in answers[:20]:
        indexes.seeded.add(answer)
    for answer in answers[20:25]:
        indexes.add("a", answer)
    draft = ContextDraft(FixedDraft([7, 7]), min_match=1, max_match=8)
    seen = collections.Counter()
    for stream in (*answers[25:], [rng.randrange(6, 60) for _ in range(60)]):
        session = draft.start(stream[:2], suffix=indexes.view("a"))
        for token in stream[2:]:
            found, may = bool(session.copies(4, 4)), session.may_copy(4)
            assert may or not found
            seen[found, may] += 1
            session.extend([token])
    assert seen[True, True] > 20 and seen[False, False] > 50
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6])
    session = draft.start([9, 2, 3, 4, 5], suffix=index)  # the 4-gram is the index's alone
    assert session.may_copy(4) and session.copies(4, 4)
    assert draft.start([2, 3, 4, 5, 0, 2, 3, 4, 5]).may_copy(4)  # its own context's
    assert not draft.start([2, 3, 4, 5, 0, 3, 4, 5]).may_copy(4)
    assert index.may_match([0, 2, 3, 4, 5], 4) and not index.may_match([0, 9, 3, 4, 5], 4)
    assert not index.may_match([3, 4, 5], 4)  # shorter than the match asked for


def test_a_longer_match_drafts_further_up_to_the_long_draft_cap() -> None:
    """k tokens after a short match; as many as the match is long after a longer one, up to
    long_draft_tokens; the static draft does not stretch."""
    text = [*range(1, 13), 0, *range(1, 13), 0]
    draft = ContextDraft(FixedDraft([7] * 12), min_match=1, max_match=16, long_draft_tokens=6)
    assert draft.start([1, 2, 0, 1]).propose(2)[0].tokens == (2, 0)  # 1-token match: k = 2
    session = draft.start(text[:17])  # 1..12 0 1 2 3 4: the last 4 tokens matched
    assert session.propose(2)[0].tokens == (5, 6, 7, 8)  # reach 4
    assert draft.start(text[:22]).propose(2)[0].tokens == (10, 11, 12, 0, 1, 2)  # cap 6
    assert draft.start([3, 4]).propose(2)[0].tokens == (7, 7)  # no match: the static draft, k
    never = ContextDraft(None, min_match=1, max_match=16, long_draft_tokens=0)
    assert never.start(text[:22]).propose(2)[0].tokens == (10, 11)


def test_kenlm_continues_where_the_context_runs_out(tmp_path) -> None:
    from kenspec.server.engine.kenlm_draft import KenLMDraft
    from tests import tiny

    # A bigram where 9 is always followed by 4, then 4 by 4 ...
    sentences = [[9, 4, 4, 4, 4, 4]] * 5
    path = tiny.train_arpa(tmp_path / "m.arpa", sentences, range(12), order=2)
    draft = ContextDraft(KenLMDraft.load(path, vocab_size=12), min_match=2, max_match=4)
    session = draft.start([3, 5, 3, 5])  # the match [3, 5] continues with [3, 5] then the present
    chain = session.propose(4)[0]
    assert chain.tokens[:2] == (3, 5)
    assert len(chain.tokens) == 4  # KenLM continued after the copied tokens


def test_for_trees_kenlm_offers_its_next_best_tokens_and_labels_tokens_by_decile(
    tmp_path,
) -> None:
    """With branches (token trees), KenLM's chain is gated at the tree's floor, not at its
    min_draft_prob, its tokens are labelled by probability decile, and its next best tokens at
    the root ride along as one-token chains."""
    from kenspec.server.engine.kenlm_draft import KenLMDraft
    from tests import tiny

    path = tiny.unigram_arpa(tmp_path / "u.arpa", {3: 0.3, 4: 0.25, 5: 0.2}, range(12))
    kenlm = KenLMDraft.load(path, vocab_size=12, min_draft_prob=0.5)
    assert ContextDraft(kenlm).start([9]).propose(2)[0].tokens == ()  # 0.3 < 0.5: no chain
    draft = ContextDraft(kenlm, branches=2)
    chains = draft.start([9]).propose(2)
    by_source = {chain.source: chain for chain in chains}
    assert by_source[Source("kenlm")].tokens == (3, 3)
    assert by_source[Source("kenlm")].token_sources == (Source("ngram", 2),) * 2
    alternatives = [chain for chain in chains if chain.source.kind == "ngram"]
    assert [c.tokens for c in alternatives] == [(4,), (5,)]
    assert [c.source for c in alternatives] == [Source("ngram", 2), Source("ngram", 1)]

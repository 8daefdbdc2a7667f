"""The global suffix index: longest exact match, majority continuation, answer boundaries,
bounded memory, learning from finished answers, and exact output with it on."""

from __future__ import annotations

import gzip

import pytest

from kenspec.api.outputs import BreakerState
from kenspec.server import runtime
from kenspec.server.engine.context_draft import ContextDraft
from kenspec.server.engine.draft_tree import Source
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.engine.speculative_engine import (
    BreakerSettings,
    ContextSettings,
    SpeculativeEngine,
)
from kenspec.server.engine.suffix_index import (
    LEAD_TOKENS,
    TEXT_PIECE_TOKENS,
    CorpusError,
    SuffixIndex,
    add_text_corpus,
)
from kenspec.server.engine.tenant_index import TenantSuffixIndex
from kenspec.server.settings import Settings
from tests.server.engine.drafts import generate


def test_the_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6, 7])  # 3 4 5 -> 6 7, after 1 2: a 5-token match below
    index.add([9, 4, 5, 8, 8])  # 4 5 -> 8 8: shorter (2 tokens), newer
    assert index.propose([1, 2, 3, 4, 5], 2) == ([6, 7], 5)
    assert index.propose([0, 0, 4, 5], 2) == ([8, 8], 2)  # only 2 tokens match either: newest


def test_a_minimum_match_searches_only_the_long_keys_and_drops_shorter_matches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """propose(min_match=4), an open breaker's copies: the same chain as without it where the
    longest match is 4+ tokens, none where it is shorter; and only the 4-gram's positions are
    searched, not the bigram's (each indexed position is checked once at most)."""
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6, 7])
    index.add([9, 4, 5, 8, 8])
    for tail in ([0, 1, 2, 3, 4, 5], [0, 0, 4, 5], [9, 3, 4, 5]):
        full = index.propose(tail, 2)
        expected = full if full[1] >= 4 else ([], 0)
        assert index.propose(tail, 2, min_match=4) == expected
    assert index.propose([2, 3, 4, 5], 2, min_match=4) == ([6, 7], 4)
    assert index.propose([0, 2, 3, 4, 5], 2, min_match=5) == ([], 0)  # 4 tokens match: short
    teams = TenantSuffixIndex(index).view("a")  # (the tenants' view: the same rule)
    assert teams.propose([0, 0, 4, 5], 2, min_match=4) == ([], 0)
    assert teams.propose([0, 1, 2, 3, 4, 5], 2, min_match=4) == ([6, 7], 5)
    checked: list[int] = []
    segment = type(index._segments[0])
    match_length = segment.match_length
    monkeypatch.setattr(
        segment,
        "match_length",
        lambda self, at, *a: checked.append(at) or match_length(self, at, *a),
    )
    index.propose([0, 0, 4, 5], 2)
    assert len(checked) == 2  # (4 5 -> 6 and 4 5 -> 8: the bigram's positions)
    checked.clear()
    index.propose([0, 0, 4, 5], 2, min_match=4)
    assert checked == []  # no 4-gram ends 0 0 4 5


def test_equally_long_matches_vote_for_the_most_frequent_continuation() -> None:
    index = SuffixIndex()
    for answer in ([5, 6, 7, 1, 1], [5, 6, 7, 1, 2], [5, 6, 7, 2, 3]):
        index.add(answer)
    tokens, matched = index.propose([5, 6, 7], 3)
    assert matched == 3
    assert tokens == [1, 2]  # 1 twice against 2 once; then a tie 1/2 goes to the newest, 2
    # The chain stops where the winning answers end: nothing runs into the next answer.
    assert index.propose([6, 7, 2], 4) == ([3], 3)


def test_no_match_below_two_tokens_and_none_for_an_empty_index() -> None:
    assert SuffixIndex().propose([1, 2, 3], 4) == ([], 0)
    index = SuffixIndex()
    index.add([1, 2, 3])
    assert index.propose([7, 3], 2) == ([], 0)  # [3] alone is too short a key
    assert index.propose([2], 2) == ([], 0)


def test_an_answer_is_drafted_from_its_first_token_after_the_same_prompt_end() -> None:
    """Indexed after its prompt's last tokens, an answer is proposed from its first token to a
    stream whose prompt ends alike; the prompt's own tokens are keys, never continuations, and
    only the last LEAD_TOKENS of it are kept."""
    index = SuffixIndex()
    prompt = [*range(100, 100 + LEAD_TOKENS + 5), 7, 8]  # 7 8: an assistant header, say
    index.add([50, 51, 52], prompt)
    assert index.tokens == LEAD_TOKENS + 3 + 1
    assert index.propose([1, 2, 7, 8], 3) == ([50, 51, 52], 2)
    tokens, matched = index.propose([9, *prompt[-6:]], 3)  # a longer match of the prompt's end
    assert (tokens, matched) == ([50, 51, 52], 6)
    assert index.propose([prompt[-5], prompt[-4]], 2) == ([], 0)  # inside the lead: no draft
    bare = SuffixIndex()
    bare.add([50, 51, 52])  # no prompt: the first token cannot be drafted, the second can
    assert bare.propose([7, 8], 3) == ([], 0)
    assert bare.propose([8, 50, 51], 1) == ([52], 2)


def test_memory_is_bounded_and_the_oldest_answers_go_first() -> None:
    index = SuffixIndex(max_tokens=40, segment_tokens=10)
    index.add([1, 2, 3, 4])
    for start in range(100, 180, 8):  # ten more 4-token answers, 5 ids each with separators
        index.add([start, start + 1, start + 2, start + 3])
    assert index.tokens <= 40
    assert index.propose([1, 2], 2) == ([], 0)  # the first answer was evicted
    assert index.propose([172, 173], 1) == ([174], 2)  # the newest is held


def test_seeded_from_a_corpus_file(tmp_path) -> None:
    corpus = tmp_path / "corpus.ids.gz"
    with gzip.open(corpus, "wt") as file:
        file.write("10 11 12 13\n\n20 21 22 23\n")
    index = SuffixIndex.from_corpus(corpus)
    assert index.tokens == 10  # two answers of four, each with a separator
    assert index.propose([20, 21], 2) == ([22, 23], 2)
    seeded, used = SuffixIndex.for_draft(tmp_path)  # a draft folder holding corpus.ids.gz
    assert (seeded.tokens, used) == (10, corpus)
    empty, none = SuffixIndex.for_draft(tmp_path / "no-such-draft")
    assert (empty.tokens, none) == (0, None)
    assert SuffixIndex.for_draft(None)[0].tokens == 0


def test_the_context_draft_takes_the_longer_of_its_own_and_the_global_match() -> None:
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6])
    draft = ContextDraft(None, min_match=1, max_match=8, suffix=index)
    own = draft.start([9, 5, 9, 1, 2, 3, 4, 5])  # own context: [5] -> 9; global: 5 tokens
    chain = own.propose(2)[0]
    assert chain.tokens == (6,) and chain.source == Source("suffix", 5)
    assert draft.start([7, 3, 4, 8, 3, 4]).propose(1)[0].source == Source("context", 2)  # a tie


def engine_with_index(tiny_target, index: TenantSuffixIndex, **breaker) -> SpeculativeEngine:
    context = ContextSettings(enabled=True, min_match=1, max_match=8)
    return SpeculativeEngine(
        tiny_target, None, BreakerSettings(**breaker), context=context, suffix=index
    )


def run(engine: SpeculativeEngine, ids: list[int], max_new: int, k: int = 6) -> list:
    generation = engine.start(
        ids,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new),
        speculation=SpeculationParams(num_draft_tokens=k, adaptive=False),
    )
    return list(engine.batch.rounds(generation))


def test_a_finished_answer_is_learned_and_a_repeat_drafts_all_of_it(
    tiny_target, references
) -> None:
    """The second time a prompt is served, the index holds its answer after its prompt's last
    tokens: every round but the last accepts all k drafts, the first round included. Both
    outputs are plain greedy decoding's."""
    index = TenantSuffixIndex()
    engine = engine_with_index(tiny_target, index)
    ids, expected = next(iter(references.values()))
    first = run(engine, ids, len(expected))
    lead = min(LEAD_TOKENS, len(ids))
    assert index.tokens == lead + len(expected) + 1  # learned after its lead, with a separator
    again = run(engine, ids, len(expected))
    for rounds in (first, again):
        assert [t for r in rounds for t in r.token_ids] == expected
    assert all(r.drafted == r.accepted > 0 for r in again[:-1])
    assert len(again) <= 1 + len(expected) // 7 < len(first)


@pytest.mark.parametrize("k", [2, 6])
def test_greedy_output_is_exact_with_a_partly_right_index(tiny_target, references, k) -> None:
    """Seeded with every other reference answer, corrupted after its 6th token: drafts are
    right, then wrong, then absent; output equals plain greedy decoding every time."""
    index = SuffixIndex()
    answers = [expected for _, expected in references.values()]
    for answer in answers[::2]:
        index.add([*answer[:6], *((token + 1) % tiny_target.vocab_size for token in answer[6:])])
    drafted = accepted = 0
    for ids, expected in references.values():
        generation = generate(tiny_target, ContextDraft(None, suffix=index), ids, k=k)
        rounds = list(generation)
        assert generation.output_ids == expected
        drafted += sum(r.drafted for r in rounds)
        accepted += sum(r.accepted for r in rounds)
    assert 0 < accepted < drafted  # the index was right sometimes and wrong sometimes


class BrokenIndex(SuffixIndex):
    def _longest(self, tail):  # type: ignore[no-untyped-def]
        raise RuntimeError("corrupt index")


def test_an_index_that_raises_trips_the_draft_fault_breaker(tiny_target, references) -> None:
    engine = engine_with_index(tiny_target, TenantSuffixIndex(BrokenIndex()), fault_max=2)
    ids, expected = next(iter(references.values()))
    rounds = run(engine, ids, len(expected))
    assert [t for r in rounds for t in r.token_ids] == expected  # decoded plainly instead
    assert engine.draft_breaker_state is BreakerState.OPEN


def test_a_chain_stops_where_its_path_probability_falls_below_the_minimum() -> None:
    """Four answers agree on 7 after [5, 6], then split two ways and two ways again: the
    path probability is 1, then 1/2, then 1/4."""
    answers = ([5, 6, 7, 1, 3], [5, 6, 7, 1, 4], [5, 6, 7, 2, 3], [5, 6, 7, 2, 4])
    for minimum, expected in ((0.0, [7, 2, 4]), (0.3, [7, 2]), (0.6, [7])):
        index = SuffixIndex(min_probability=minimum)
        index.add_all(answers)
        assert index.propose([5, 6], 3) == (expected, 2), minimum


@pytest.mark.parametrize(
    ("content", "names"),
    [
        (b"10 11 12\n", "Not a gzipped file"),  # a plain file named .gz
        (gzip.compress(b"10 11 12 13\n20 21 22 23\n")[:-12], "line"),  # truncated
        (gzip.compress(b"10 11 12 13\n20 x 22\n"), "line 2"),
        (gzip.compress(b"10 11 12 13\n20 21 99999\n"), "line 2: token id 99999 is outside"),
        (gzip.compress(b"10 -3 12\n"), "token id -3"),
    ],
)
def test_an_unusable_corpus_is_refused_naming_the_file(
    tmp_path, tiny_target, content, names
) -> None:
    corpus = tmp_path / "corpus.ids.gz"
    corpus.write_bytes(content)
    with pytest.raises(CorpusError) as error:
        SuffixIndex.from_corpus(corpus, vocab_size=1000)
    assert str(corpus) in str(error.value) and names in str(error.value)
    # The server refuses to start with it, with the same message (kenspec serve exits 1).
    settings = Settings.of(draft=str(tmp_path), draft_context=True, suffix_index=True)
    with pytest.raises(CorpusError, match=r"corpus\.ids\.gz"):
        runtime._load_suffix_index(settings, tiny_target)


def test_a_text_corpus_is_indexed_by_passage(tmp_path, tiny_target) -> None:
    corpus = tmp_path / "notes.txt"
    corpus.write_text("The quick brown fox\njumps over the lazy dog.\n\n \nOne pass.\n")
    seen: list[list[str]] = []

    def encode(texts: list[str]) -> list[list[int]]:
        seen.append(texts)
        return [
            tiny_target.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts
        ]

    index = SuffixIndex()
    added = add_text_corpus(index, corpus, encode)
    assert seen == [["The quick brown fox\njumps over the lazy dog.", "One pass."]]
    assert added == sum(len(ids) for ids in encode(seen[0]))
    fox = encode(["The quick brown fox\njumps"])[0]
    found, length = index.propose(fox[:-1], 3)
    assert length >= 2 and found[:1] == fox[-1:]
    corpus.write_bytes(b"caf\xe9\n")  # Latin-1, not UTF-8
    with pytest.raises(CorpusError, match=r"notes\.txt is unusable"):
        add_text_corpus(SuffixIndex(), corpus, encode)


def test_a_long_passage_is_indexed_in_pieces_and_keeps_its_start(tmp_path) -> None:
    corpus = tmp_path / "long.txt"
    corpus.write_text("x")
    long_ids = list(range(10, 10 + 3 * TEXT_PIECE_TOKENS))
    index = SuffixIndex(max_tokens=10 * TEXT_PIECE_TOKENS, segment_tokens=TEXT_PIECE_TOKENS + 8)
    assert add_text_corpus(index, corpus, lambda texts: [long_ids]) == len(long_ids)
    assert index.propose([10, 11, 12, 13], 2) == ([14, 15], 4)

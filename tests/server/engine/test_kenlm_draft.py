"""KenLM draft: the successor index finds the exact argmax; gating, </s>, formats and errors."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import kenlm
import pytest

from kenspec.server.engine.arpa import SENTENCE_END, SENTENCE_START, DraftFormatError, read_arpa
from kenspec.server.engine.kenlm_draft import KenLMDraft
from kenspec.server.engine.successors import SuccessorIndex
from tests import tiny

VOCAB = 60


@pytest.fixture(scope="module")
def arpa_path(tmp_path_factory) -> Path:
    """A 4-gram over skewed random sentences: many contexts, backoffs at every level."""
    rng = random.Random(7)
    weights = [1.0 / (rank + 1) for rank in range(VOCAB)]
    sentences = [rng.choices(range(VOCAB), weights, k=rng.randint(3, 15)) for _ in range(300)]
    path = tmp_path_factory.mktemp("kenlm") / "model.arpa"
    return tiny.train_arpa(path, sentences, range(VOCAB), order=4)


@pytest.fixture(scope="module")
def draft(arpa_path: Path) -> KenLMDraft:
    return KenLMDraft.load(arpa_path, vocab_size=VOCAB)


def brute_force_best(model: kenlm.Model, state: kenlm.State) -> tuple[int, float]:
    """Score every word of the vocabulary (and </s>); ties go to the smaller id."""
    best = None
    for token in [*range(VOCAB), SENTENCE_END]:
        word = "</s>" if token == SENTENCE_END else str(token)
        score = model.BaseScore(state, word, kenlm.State())
        if best is None or (score, -token) > (best[1], -best[0]):
            best = (token, score)
    return best


def test_successor_index_agrees_with_brute_force_argmax(draft: KenLMDraft) -> None:
    rng = random.Random(11)
    contexts = [[]] + [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(400)]
    contexts += [[0], [0, 1], [1, 0, 2], [59, 58]]
    for context in contexts:
        state, history = draft._state_after(context)
        step = draft.best_next(state, history)
        expected_token, expected_score = brute_force_best(draft._model, state)
        assert (step.token_id, pytest.approx(step.logprob)) == (expected_token, expected_score), (
            context
        )


def test_a_chain_is_the_exact_argmaxes(draft: KenLMDraft) -> None:
    context = [0, 1]
    chain = draft.chain(context, 6)
    assert 1 <= len(chain) <= 6
    history = list(context)
    for token, prob in zip(chain.tokens, chain.confidences, strict=True):
        state, _ = draft._state_after(history)
        expected_token, expected_score = brute_force_best(draft._model, state)
        assert token == expected_token
        assert prob == pytest.approx(10**expected_score)
        history.append(token)


def test_confidence_gate_stops_at_low_probability(arpa_path: Path) -> None:
    ungated = KenLMDraft.load(arpa_path, vocab_size=VOCAB).chain([3], 8)
    cutoff = sorted(ungated.confidences)[len(ungated.confidences) // 2]
    gated = KenLMDraft.load(arpa_path, vocab_size=VOCAB, min_draft_prob=cutoff).chain([3], 8)
    first_low = next(i for i, p in enumerate(ungated.confidences) if p < cutoff)
    assert gated.tokens == ungated.tokens[:first_low]
    assert all(p >= cutoff for p in gated.confidences)
    assert (
        KenLMDraft.load(arpa_path, vocab_size=VOCAB, min_draft_prob=1.0).chain([3], 8).tokens == ()
    )


def test_sentence_end_stops_drafting_or_becomes_eos(tmp_path: Path) -> None:
    # After "5", </s> is certain; "4" is followed by "5".
    path = tiny.write_arpa(
        tmp_path / "end.arpa",
        [
            {
                ("<s>",): (-99.0, 0.0),
                ("</s>",): (-1.0, 0.0),
                ("<unk>",): (-9.0, 0.0),
                ("4",): (-0.5, -0.1),
                ("5",): (-0.5, -0.1),
            },
            {("4", "5"): (-0.01, 0.0), ("5", "</s>"): (-0.01, 0.0), ("<s>", "4"): (-0.01, 0.0)},
        ],
    )
    plain = KenLMDraft.load(path, vocab_size=10)
    assert plain.chain([], 5).tokens == (4, 5)
    with_eos = KenLMDraft.load(path, vocab_size=10, end_token_id=9)
    assert with_eos.chain([], 5).tokens == (4, 5, 9)


def test_sentence_start_context_is_used(draft: KenLMDraft) -> None:
    _, history = draft._state_after([])
    assert history == (SENTENCE_START,)
    _, long_history = draft._state_after([1, 2, 3, 4, 5])
    assert long_history == (3, 4, 5)  # order 4: three words of context


def test_words_that_are_not_token_ids_are_rejected(tmp_path: Path) -> None:
    path = tiny.write_arpa(
        tmp_path / "words.arpa",
        [
            {("<s>",): (-99.0, 0.0), ("</s>",): (-1.0, 0.0), ("the",): (-0.5, 0.0)},
            {("<s>", "the"): (-0.1, 0.0)},
        ],
    )
    with pytest.raises(DraftFormatError, match="not a token id"):
        KenLMDraft.load(path, vocab_size=10)


def test_token_ids_outside_the_target_vocabulary_are_rejected(arpa_path: Path) -> None:
    with pytest.raises(DraftFormatError, match="outside the target vocabulary"):
        KenLMDraft.load(arpa_path, vocab_size=VOCAB - 10)


def write_draft_dir(arpa_path: Path, directory: Path, **manifest) -> Path:
    directory.mkdir()
    tables = read_arpa(arpa_path)
    SuccessorIndex.from_tables(tables).save(directory / "successors.npz", tables)
    (directory / "model.arpa").write_bytes(arpa_path.read_bytes())
    (directory / "draft.json").write_text(json.dumps({"model": "model.arpa", **manifest}))
    return directory


def test_draft_directory_loads_and_checks_tokenizer(arpa_path: Path, tmp_path: Path) -> None:
    directory = write_draft_dir(
        arpa_path, tmp_path / "d", vocab_size=VOCAB, tokenizer_fingerprint="abc"
    )
    loaded = KenLMDraft.load(directory, vocab_size=VOCAB, fingerprint="abc")
    assert loaded.chain([0, 1], 4) == KenLMDraft.load(arpa_path).chain([0, 1], 4)
    with pytest.raises(DraftFormatError, match="another tokenizer"):
        KenLMDraft.load(directory, vocab_size=VOCAB, fingerprint="xyz")
    with pytest.raises(DraftFormatError, match="vocabulary of"):
        KenLMDraft.load(directory, vocab_size=VOCAB + 1)


def test_missing_draft_and_binary_without_index(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        KenLMDraft.load(tmp_path / "nope.arpa")
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"mmap lm http://kheafield.com/code format version 5\n\0")
    with pytest.raises(DraftFormatError, match="successor index"):
        KenLMDraft.load(binary)


def test_index_round_trips_through_sidecar(arpa_path: Path, tmp_path: Path) -> None:
    tables = read_arpa(arpa_path)
    index = SuccessorIndex.from_tables(tables)
    index.save(tmp_path / "s.npz", tables)
    loaded = SuccessorIndex.load(tmp_path / "s.npz", vocab_size=VOCAB)
    assert loaded.spans == index.spans and loaded.words == index.words
    assert loaded.backoffs.keys() == index.backoffs.keys()
    assert all(math.isclose(loaded.backoffs[k], v, abs_tol=1e-6) for k, v in index.backoffs.items())


def brute_force_top(model: kenlm.Model, state: kenlm.State, n: int) -> list[tuple[int, float]]:
    """Every word of the vocabulary (and </s>) scored, the n best; ties to the smaller id."""
    scored = []
    for token in [*range(VOCAB), SENTENCE_END]:
        word = "</s>" if token == SENTENCE_END else str(token)
        scored.append((token, model.BaseScore(state, word, kenlm.State())))
    return sorted(scored, key=lambda pair: (-pair[1], pair[0]))[:n]


@pytest.mark.parametrize("n", [2, 3, 8])
def test_n_best_agrees_with_brute_force(draft: KenLMDraft, n: int) -> None:
    rng = random.Random(13)
    contexts = [[]] + [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(150)]
    for context in contexts:
        state, history = draft._state_after(context)
        got = [(step.token_id, step.logprob) for step in draft.top_next(state, history, n)]
        expected = brute_force_top(draft._model, state, n)
        assert [token for token, _ in got] == [token for token, _ in expected], context
        assert [score for _, score in got] == pytest.approx([score for _, score in expected])


def test_n_best_reports_probabilities_and_maps_sentence_end(arpa_path: Path) -> None:
    with_end = KenLMDraft.load(arpa_path, vocab_size=VOCAB, end_token_id=VOCAB - 1)
    without_end = KenLMDraft.load(arpa_path, vocab_size=VOCAB)
    context = [3, 1]
    best = with_end.n_best(context, 61)  # every word and </s>
    assert len(best) == 61 and 0.9 < sum(p for _, p in best) <= 1.0  # the rest is <unk>'s
    assert [p for _, p in best] == sorted((p for _, p in best), reverse=True)
    assert len(without_end.n_best(context, 61)) == 60  # </s> left out without an EOS id
    assert best[0][0] == with_end.chain(context, 1).tokens[0]


def test_a_session_offers_what_a_context_draft_asks_of_a_static_draft(draft: KenLMDraft) -> None:
    """KenLMSession is a StaticSession: its candidates are its one chain, which it also gives
    behind another gate, after given tokens, and its n-best next tokens."""
    session = draft.start([1, 2])  # the prompt is not the n-gram's context
    session.extend([3, 4, 5, 6])
    assert session.propose(3) == (draft.chain([3, 4, 5, 6], 3),)
    assert session.chain(3, 1.0) == draft.chain([3, 4, 5, 6], 3, min_prob=1.0)
    assert session.chain_after([7], 2) == draft.chain([5, 6, 7], 2)
    assert session.n_best(3) == draft.n_best([4, 5, 6], 3)
    assert session.branching() is None  # chains only


def test_remembered_answers_are_the_answers_computed_afresh(
    arpa_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chains and n-best lists asked again (the next round's context is the last round's
    chain one token on), across the forgetting of a full memory, equal a fresh draft's: short
    contexts (the sentence's start) and full windows alike."""
    import kenspec.server.engine.kenlm_draft as module

    monkeypatch.setattr(module, "REMEMBERED", 50)  # forgotten several times below
    remembering = KenLMDraft.load(arpa_path, vocab_size=VOCAB)
    rng = random.Random(5)
    contexts = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 7))] for _ in range(120)]
    contexts += [context[: len(context) - 1] for context in contexts[:40]] * 2  # asked again
    fresh = KenLMDraft.load(arpa_path, vocab_size=VOCAB)
    for context in contexts:
        fresh._tops.clear()
        fresh._states.clear()
        assert remembering.chain(context, 5) == fresh.chain(context, 5), context
        assert remembering.n_best(context, 3) == fresh.n_best(context, 3), context
        fresh._tops.clear()
        fresh._states.clear()
        assert remembering._state_after(context) == fresh._state_after(context), context
    assert 0 < len(remembering._tops) <= 50

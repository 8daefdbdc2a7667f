"""The draft training pipeline end to end on the tiny model, with the real lmplz/build_binary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kenspec.draft_tools import train as train_draft
from kenspec.server.engine.arpa import DraftFormatError
from kenspec.server.engine.kenlm_draft import KenLMDraft, tokenizer_fingerprint
from kenspec.server.engine.params import SpeculationParams
from tests import tiny
from tests.server.engine.drafts import reference_greedy


@pytest.fixture(scope="module")
def answers(tiny_target) -> list[tuple[str, list[int]]]:
    """(prompt, greedy answer) pairs of the tiny model, as `distill` would write them."""
    result = []
    for prompt in tiny.PROMPTS:
        ids = tiny_target.encode_chat([{"role": "user", "content": prompt}])
        result.append((prompt, reference_greedy(tiny_target, ids, 20)))
    return result


def write_distill_corpus(path: Path, answers) -> Path:
    path.write_text("".join(" ".join(map(str, ids)) + "\n" for _, ids in answers))
    records = [{"index": i, "prompt": p, "stop": "length"} for i, (p, _) in enumerate(answers)]
    path.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_train_writes_a_loadable_draft_and_eval_replays_it(
    tiny_model_dir, tiny_target, answers, tmp_path
) -> None:
    corpus = write_distill_corpus(tmp_path / "corpus.ids", answers * 3)
    manifest = train_draft.train(tiny_model_dir, corpus, tmp_path / "draft", order=3)
    assert manifest["order"] == 3 and manifest["corpus_lines"] == 3 * len(answers)
    assert manifest["tokenizer_fingerprint"] == tokenizer_fingerprint(
        tiny_target.tokenizer.get_vocab()
    )
    assert (tmp_path / "draft" / "model.bin").stat().st_size > 0
    draft = KenLMDraft.load(
        tmp_path / "draft",
        vocab_size=tiny_target.vocab_size,
        fingerprint=tokenizer_fingerprint(tiny_target.tokenizer.get_vocab()),
    )
    assert draft.order == 3
    # Trained on exactly these answers, the draft predicts them well when replayed.
    stats = train_draft.evaluate(
        tiny_model_dir, tmp_path / "draft", corpus, k=4, adaptive=False, min_draft_prob=0.0
    )
    assert stats.tokens == 3 * len(answers) * 20
    assert stats.tokens_per_round > 2.0
    assert len(stats.per_position) == 4 and stats.per_position[0] >= stats.per_position[3]
    assert "tokens/round=" in train_draft.report(stats)


def test_replay_equals_live_speculative_rounds(tiny_model_dir, tiny_target, answers, tmp_path):
    """The replay's acceptance is what a real greedy run with the same draft does."""
    corpus = write_distill_corpus(tmp_path / "corpus.ids", answers[:8])
    train_draft.train(tiny_model_dir, corpus, tmp_path / "draft", order=3)
    draft = KenLMDraft.load(tmp_path / "draft")
    prompts, replies = train_draft.load_answers(tiny_model_dir, corpus)
    params = SpeculationParams(num_draft_tokens=4, adaptive=True)
    stats = train_draft.replay(draft, prompts, replies, params)
    from tests.server.engine.drafts import generate

    live_rounds = live_accepted = 0
    for prompt_ids, reply in zip(prompts, replies, strict=True):
        generation = generate(
            tiny_target, draft, prompt_ids, max_new_tokens=len(reply), k=4, adaptive=True
        )
        rounds = list(generation)
        assert generation.output_ids == reply
        live_rounds += len(rounds)
        live_accepted += rounds[-1].usage.accepted_tokens
    assert (stats.rounds, stats.accepted) == (live_rounds, live_accepted)


def test_tokenize_text(tiny_model_dir, tiny_target, tmp_path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox\n\nCafé naïve\n")
    count = train_draft.tokenize_text(tiny_model_dir, text, tmp_path / "out.ids")
    lines = (tmp_path / "out.ids").read_text().splitlines()
    assert len(lines) == 2  # the blank line is skipped
    first = [int(t) for t in lines[0].split()]
    assert (
        first == tiny_target.tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    )
    assert count == sum(len(line.split()) for line in lines)


def test_draft_for_another_tokenizer_is_refused(tiny_model_dir, answers, tmp_path) -> None:
    corpus = write_distill_corpus(tmp_path / "corpus.ids", answers)
    train_draft.train(tiny_model_dir, corpus, tmp_path / "draft", order=3)
    with pytest.raises(DraftFormatError, match="another tokenizer"):
        KenLMDraft.load(tmp_path / "draft", fingerprint="0000000000000000")


def test_missing_tools_say_how_to_build_them(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(train_draft, "REPO_ROOT", tmp_path)
    monkeypatch.delenv("KENSPEC_TOOLS_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"build_kenlm_tools\.sh"):
        train_draft.kenlm_tool("lmplz")


def test_eval_replays_the_suffix_index_learning_in_sequence(
    tiny_model_dir, answers, tmp_path
) -> None:
    """Answers replayed twice in sequence: with --learn the index holds each answer the
    second time, so it drafts more of them than without learning, and more than context
    drafting alone (no draft folder, so the index starts empty)."""
    corpus = write_distill_corpus(tmp_path / "corpus.ids", answers * 2)
    options = dict(k=4, adaptive=False, min_draft_prob=0.0, context=True)
    alone = train_draft.evaluate(tiny_model_dir, None, corpus, **options)
    index = train_draft.evaluate(tiny_model_dir, None, corpus, **options, suffix=True)
    learning = train_draft.evaluate(
        tiny_model_dir, None, corpus, **options, suffix=True, learn=True
    )
    assert index.tokens_per_round == alone.tokens_per_round  # an empty index adds nothing
    assert learning.tokens_per_round > alone.tokens_per_round + 0.5

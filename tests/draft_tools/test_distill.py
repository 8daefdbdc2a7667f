"""draft_tools/distill.py: answers through the server's engine, batched as one at a time; the
resumable corpus; end to end on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kenspec.draft_tools import distill
from kenspec.draft_tools.distill import Answer, CorpusWriter
from tests.server.engine.drafts import reference_greedy


def _answer(index: int, text: str = "a\nb") -> Answer:
    return Answer(index, f"prompt {index}", [index, 7], "eos", text)


def test_corpus_writer_resumes_and_drops_a_half_written_line(tmp_path: Path) -> None:
    out = tmp_path / "corpus.ids"
    writer = CorpusWriter(out).open()
    writer.write(_answer(3))
    writer.write(_answer(0))
    writer.close()
    with out.open("a") as f:  # a crash after corpus.ids got a line, before corpus.jsonl did
        f.write("1 7\n")
    with out.with_suffix(".jsonl").open("a") as f:
        f.write('{"index": 1, "pro')

    writer = CorpusWriter(out).open()
    assert writer.done == {0, 3}
    writer.write(_answer(1))
    writer.close()
    assert out.read_text() == "3 7\n0 7\n1 7\n"
    assert out.with_suffix(".txt").read_text() == "a\\nb\na\\nb\na\\nb\n"
    records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert [(r["index"], r["n_tokens"], r["text"]) for r in records] == [
        (3, 2, "a\nb"),
        (0, 2, "a\nb"),
        (1, 2, "a\nb"),
    ]


def test_resume_refuses_other_settings(tmp_path: Path) -> None:
    meta = tmp_path / "corpus.meta.json"
    distill.check_run_settings(meta, {"max_new_tokens": 256})
    distill.check_run_settings(meta, {"max_new_tokens": 256})
    with pytest.raises(SystemExit, match="other settings"):
        distill.check_run_settings(meta, {"max_new_tokens": 128})


def generated(target, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], str]:
    """transformers' greedy answer as a corpus keeps it: cut before the first EOS."""
    reference = reference_greedy(target, prompt_ids, max_new_tokens)
    for position, token in enumerate(reference):
        if token in target.eos_token_ids:
            return reference[:position], "eos"
    return reference, "length"


@pytest.fixture(scope="module")
def engine_target(tiny_model_dir: Path) -> distill.Target:
    return distill.load_target(tiny_model_dir, "cpu", "float32", rows=4, threads=1)


def test_batched_answers_equal_single_answers_and_generate(engine_target, tiny_target) -> None:
    """Greedy, float32: the engine answering many prompts a pass (continuous batching: 6
    prompts through 4 rows) gives each the answer it gives alone, and transformers' generate."""
    prompts = ["The quick brown fox", "A", "Speculative decoding drafts tokens and verifies"]
    prompts += ["dog fox dog fox", "quick quick quick", "over the"]
    rows = {i: distill.render_prompt(engine_target.tokenizer, p) for i, p in enumerate(prompts)}
    assert len({len(r) for r in rows.values()}) > 3  # rows of many lengths share passes
    together = distill.greedy_answers(engine_target, rows, 12)
    alone = {i: distill.greedy_answers(engine_target, {i: rows[i]}, 12)[i] for i in rows}
    assert together == alone
    for i, answer in together.items():
        assert answer == generated(tiny_target, rows[i], 12)


def test_answers_come_in_index_order_whichever_finishes_first(engine_target) -> None:
    rows = {5: [1, 2, 3] * 9, 1: [4, 5], 3: [6, 7, 8]}
    seen: list[int] = []
    distill.answer_all(engine_target, rows, 4, lambda i, ids, stop: seen.append(i))
    assert seen == [1, 3, 5]


def test_main_writes_aligned_corpus_and_resumes(
    tiny_model_dir: Path, tmp_path: Path, engine_target, tiny_target
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n\nAn n-gram model\n1 2 3\n")
    out = tmp_path / "drafts" / "corpus.ids"
    argv = ["--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--max-new-tokens", "8", "--batch-size", "2"]
    assert distill.main(argv) == 0

    tokenizer = engine_target.tokenizer
    eos = tokenizer.eos_token_id
    records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    id_lines = out.read_text().splitlines()
    assert [r["index"] for r in records] == [0, 2, 3]  # line 1 is blank; in file order
    assert len(id_lines) == len(out.with_suffix(".txt").read_text().splitlines()) == 3
    for record, line in zip(records, id_lines, strict=True):
        ids = [int(t) for t in line.split()]
        assert eos not in ids and tokenizer.pad_token_id not in ids
        assert len(ids) == record["n_tokens"] <= 8
        assert tokenizer.decode(ids) == record["text"]
        rendered = distill.render_prompt(tokenizer, record["prompt"])
        assert record["prompt_ids"] == rendered
        assert (ids, record["stop"]) == generated(tiny_target, rendered, 8)

    before = out.read_text()
    assert distill.main(argv) == 0  # everything done: nothing appended
    assert out.read_text() == before
    with pytest.raises(SystemExit):
        distill.main([*argv[:-4], "--max-new-tokens", "9", "--batch-size", "2"])


def test_keep_answers_renumbers_those_still_asked(tmp_path: Path) -> None:
    out = tmp_path / "corpus.ids"
    writer = CorpusWriter(out).open()
    for index, prompt in enumerate(["a", "b", "a", "c"]):
        writer.write(Answer(index, prompt, [index, 7], "eos", f"answer {index}\u2028to {prompt}"))
    writer.close()
    with out.with_suffix(".jsonl").open("a") as f:
        f.write('{"index": 4, "pro')  # a crash mid-line: dropped, as a resume would

    # "b" is gone, "a" asked once now (its first answer kept), "c" moved, "d" is new.
    kept = distill.keep_answers(out, [(0, "d"), (1, "c"), (3, "a")])
    assert kept == 2
    jsonl = out.with_suffix(".jsonl").read_text().split("\n")  # not splitlines: \u2028 in text
    records = [json.loads(line) for line in jsonl if line]
    assert [(r["index"], r["prompt"], r["text"]) for r in records] == [
        (3, "a", "answer 0\u2028to a"),
        (1, "c", "answer 3\u2028to c"),
    ]
    assert out.read_text() == "0 7\n3 7\n"
    assert out.with_suffix(".txt").read_text() == "answer 0\u2028to a\nanswer 3\u2028to c\n"
    assert CorpusWriter(out).open().done == {1, 3}

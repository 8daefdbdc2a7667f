"""`python -m draft_tools head`: a head trained from a draft folder's answers, resumable."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from kenspec.draft_tools import head as head_tool
from kenspec.server.engine.draft_head import HEAD_MANIFEST, DraftHead, HeadChain
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import reference_greedy


@pytest.fixture(scope="module")
def draft_folder(tiny_model_dir, tmp_path_factory):
    """A draft folder whose corpus is the tiny model's greedy answers to tiny.PROMPTS (as a
    chat: the byte tokenizer has a template), and the prompts file, in order."""
    target = TargetModel.load(tiny_model_dir, device="cpu", dtype="float32")
    folder = tmp_path_factory.mktemp("draft")
    prompts = folder / "prompts.txt"
    prompts.write_text("".join(p.replace("\n", " ") + "\n" for p in tiny.PROMPTS))
    lines = []
    for prompt in prompts.read_text().splitlines():
        ids = target.encode_chat([{"role": "user", "content": prompt.strip()}])
        lines.append(" ".join(map(str, reference_greedy(target, ids, 16))))
    with gzip.open(folder / "corpus.ids.gz", "wt") as corpus:
        corpus.write("".join(line + "\n" for line in lines))
    return folder, prompts, target


def _args(tiny_model_dir, folder, prompts, *extra: str):
    return head_tool.parse_args(
        [
            "--model", str(tiny_model_dir), "--draft", str(folder), "--prompts", str(prompts),
            "--dtype", "float32", "--vocabulary", "32", "--inner", "16", "--epochs", "3",
            "--batch", "32", "--heldout", "0.3", *extra,
        ]
    )  # fmt: skip


def test_head_trains_checks_and_saves_a_loadable_head(tiny_model_dir, draft_folder) -> None:
    folder, prompts, target = draft_folder
    said: list[str] = []
    manifest = head_tool.build(_args(tiny_model_dir, folder, prompts), say=said.append)
    assert (folder / HEAD_MANIFEST).is_file()
    assert json.loads((folder / HEAD_MANIFEST).read_text()) == manifest
    check = manifest["heldout_check"]
    assert check["answers"] > 0 and check["tokens_per_round"] >= 1.0
    assert len(manifest["losses"]) == 3 and manifest["losses"][2] < manifest["losses"][0]
    assert 0 < manifest["covered"] <= 1 and manifest["vocabulary"] == 32
    loaded = DraftHead.load(folder, target.model)
    assert loaded is not None and loaded.vocabulary == 32
    assert any(line.startswith("features: ") for line in said)
    # A rerun reuses the features and the finished epochs, and writes the same head.
    weights = (folder / "head.safetensors").read_bytes()
    said.clear()
    again = head_tool.build(_args(tiny_model_dir, folder, prompts), say=said.append)
    assert "features: reused" in " ".join(said) and "resumed after epoch 3" in " ".join(said)
    assert again["losses"] == manifest["losses"]
    assert (folder / "head.safetensors").read_bytes() == weights
    # Another corpus (an answer changed): its hidden states and training anew.
    corpus = folder / "corpus.ids.gz"
    with gzip.open(corpus, "rt") as read:
        lines = read.read().splitlines()
    original = corpus.read_bytes()
    try:
        with gzip.open(corpus, "wt") as changed:
            changed.write("".join(line + "\n" for line in [lines[0] + " 65", *lines[1:]]))
        said.clear()
        head_tool.build(_args(tiny_model_dir, folder, prompts), say=said.append)
        assert "features: reused" not in " ".join(said)
        assert "starting over" in " ".join(said)
    finally:
        corpus.write_bytes(original)


def test_the_check_replays_the_head_chain_alone() -> None:
    """An answer the head drafts perfectly: every round accepts the whole chain."""

    class Perfect(DraftHead):
        def __init__(self, answer: list[int]) -> None:
            self.answer, self.max_tokens = answer, 8

        def chain(self, feature, token, k, min_prob=None):  # type: ignore[no-untyped-def]
            at = int(feature[0])  # (the test's features hold their position)
            tokens = tuple(self.answer[at + 2 : at + 2 + k])
            return HeadChain(tokens, tuple(1.0 for _ in tokens))

    answer = list(range(10, 24))  # 14 positions: the pending token, then 13 to emit
    features = torch.arange(len(answer), dtype=torch.float32)[:, None].repeat(1, 4)
    example = head_tool.Example(torch.tensor(answer), features)
    report = head_tool.check(Perfect(answer), [example], k=3)
    assert report["tokens"] == 13
    assert report["tokens_per_round"] == pytest.approx(13 / 4)  # 4 + 4 + 4 + 1
    assert report["acceptance_by_depth"] == [1.0, 1.0, 1.0]


def test_prompts_that_do_not_match_the_corpus_are_refused(
    tiny_model_dir, draft_folder, tmp_path, capsys
) -> None:
    folder, _, _ = draft_folder
    fewer = tmp_path / "fewer.txt"
    fewer.write_text("one prompt\n")
    argv = ["--model", str(tiny_model_dir), "--draft", str(folder), "--prompts", str(fewer)]
    assert head_tool.main(argv) == 1
    assert "1 prompts but" in capsys.readouterr().err
    assert head_tool.main([*argv[:3], str(tmp_path), "--prompts", str(fewer)]) == 1
    assert "corpus.ids.gz not found" in capsys.readouterr().err


def test_build_kind_head_trains_the_head_beside_the_draft(tiny_model_dir, draft_folder) -> None:
    from kenspec.draft_tools import build

    folder, prompts, _ = draft_folder
    argv = ["--kind", "head", "--model", str(tiny_model_dir), "--out", str(folder),
            "--prompts", str(prompts), "--dtype", "float32", "--vocabulary", "16",
            "--inner", "8", "--epochs", "1", "--heldout", "0"]  # fmt: skip
    assert build.main(argv) == 0
    assert json.loads((folder / HEAD_MANIFEST).read_text())["vocabulary"] == 16
    assert build.main(["--kind", "gpt", "--model", "m", "--out", "o"]) == 2

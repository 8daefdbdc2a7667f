"""Shared fixtures: tiny models saved to a temp dir and loaded through TargetModel.load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine.target import TargetModel
from tests import tiny
from tests.engine.drafts import reference_greedy

torch.set_num_threads(1)  # tiny models: threads only add overhead on the 2-core CI machine


class FakeClock:
    """A clock for the breakers (`clock=`): time moves only when a test advances it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-byte-model")
    return tiny.save_tiny_model(directory, tiny.build_byte_tokenizer())


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir: Path) -> TargetModel:
    return TargetModel.load(tiny_model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def word_target(tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    """A 9-word vocabulary (plus specials) for distribution tests; one layer, sharp-ish logits."""
    directory = tmp_path_factory.mktemp("tiny-word-model")
    words = ["red", "green", "blue", "cat", "dog", "runs", "sleeps", "and", "the"]
    tiny.save_tiny_model(directory, tiny.build_word_tokenizer(words), seed=3, layers=1)
    return TargetModel.load(directory, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_draft_path(tiny_target, tmp_path_factory) -> Path:
    """A trigram over the first tokens of the tiny model's greedy answers: partly matching."""
    sentences = [
        reference_greedy(tiny_target, tiny_target.encode_prompt(prompt), 10)
        for prompt in tiny.PROMPTS
    ]
    path = tmp_path_factory.mktemp("draft") / "tiny.arpa"
    return tiny.train_arpa(path, sentences, range(len(tiny_target.tokenizer)), order=3)

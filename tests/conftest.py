"""Shared fixtures: tiny models saved to a temp dir and loaded through TargetModel.load, a fake
clock for the breakers, `kenspec serve` processes over the tiny model, and a /metrics scrape."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from harness.server_process import ServerProcess
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import reference_greedy

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


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tiny_draft_path) -> Iterator[Callable[..., ServerProcess]]:
    """tiny_server(*flags) -> a ready `kenspec serve` process over the tiny model and draft
    (greedy threshold 0, one thread). Stop it when done; any still running are stopped at the
    end of the session."""
    started: list[ServerProcess] = []

    def start(*extra: str) -> ServerProcess:
        flags = ["--model", str(tiny_model_dir), "--draft", str(tiny_draft_path)]
        flags += ["--device", "cpu", "--dtype", "float32", "--breaker-threshold", "0"]
        flags += ["--no-live-costs"]  # drafts priced by the start-up table: verified
        process = ServerProcess([*flags, "--threads", "1", *extra], timeout=120)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


class MetricSamples(dict):
    """One scrape of /metrics: (sample name, sorted labels) -> value."""

    def value(self, name: str, **labels: str) -> float:
        """The sample's value; 0 for a labelled sample not exported yet."""
        return self.get((name, tuple(sorted(labels.items()))), 0.0)


def _scrape(port: int) -> MetricSamples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return MetricSamples(
        ((sample.name, tuple(sorted(sample.labels.items()))), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    )


@pytest.fixture(scope="session")
def scrape() -> Callable[[int], MetricSamples]:
    """scrape(metrics_port) -> MetricSamples, read with `.value(name, **labels)`."""
    return _scrape

"""Engine fixtures shared by the exactness, batch and prefix-cache tests: reference greedy
answers of the tiny model and drafts that match them partly or never."""

from __future__ import annotations

import pytest
import torch

from kenspec.server.engine.kenlm_draft import KenLMDraft
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import never_matching_kenlm, reference_greedy

REFERENCE_TOKENS = 24


@pytest.fixture(scope="session")
def references(tiny_target: TargetModel) -> dict[str, tuple[list[int], list[int]]]:
    """prompt -> (prompt ids, plain transformers greedy continuation of REFERENCE_TOKENS)."""
    result = {}
    for prompt in tiny.PROMPTS:
        ids = tiny_target.encode_prompt(prompt)
        result[prompt] = (ids, reference_greedy(tiny_target, ids, REFERENCE_TOKENS))
    return result


@pytest.fixture(scope="session")
def partly_matching(tiny_target, references, tmp_path_factory) -> KenLMDraft:
    """A trigram over the first 10 reference tokens of every prompt: right early, wrong later."""
    sentences = [continuation[:10] for _, continuation in references.values()]
    path = tmp_path_factory.mktemp("arpa") / "partly.arpa"
    tiny.train_arpa(path, sentences, range(len(tiny_target.tokenizer)), order=3)
    return KenLMDraft.load(path, vocab_size=tiny_target.vocab_size)


@pytest.fixture(scope="session")
def never_matching(tiny_target, references, tmp_path_factory) -> KenLMDraft:
    """A unigram whose best token no reference answer contains: every draft is rejected."""
    seen = {token for _, continuation in references.values() for token in continuation}
    path = tmp_path_factory.mktemp("arpa") / "never.arpa"
    return never_matching_kenlm(tiny_target, path, seen)


NO_CUDA = "no CUDA device: runs in scripts/gpu_check.sh"


@pytest.fixture(
    scope="session",
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
            ],
        ),
    ],
)
def device(request: pytest.FixtureRequest) -> str:
    """The devices the engine runs on: cpu always, cuda where a CUDA device exists (tests
    marked `cuda`, run on a GPU machine by scripts/gpu_check.sh)."""
    return request.param

"""Drafts with known behaviour for engine tests: oracle (always right), fixed, never matching."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from server.engine.draft import Proposal
from server.engine.generation import Generation
from server.engine.kenlm_draft import KenLMDraft
from server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from server.engine.speculative_engine import BreakerSettings, SpeculativeEngine
from server.engine.target import TargetModel
from tests import tiny


def reference_greedy(
    target: TargetModel, prompt_ids: Sequence[int], max_new_tokens: int
) -> list[int]:
    """What plain transformers greedy decoding gives: the ground truth for exactness tests."""
    input_ids = torch.tensor([list(prompt_ids)])
    output = target.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    return output[0, len(prompt_ids) :].tolist()


class OracleDraft:
    """Proposes the target's own greedy continuation (from a reference run): always accepted."""

    name = "oracle"

    def __init__(self, continuation: Sequence[int]) -> None:
        self._continuation = list(continuation)

    def start(self, prompt_ids: Sequence[int]) -> _ListSession:
        return _ListSession(self._continuation)


class _ListSession:
    def __init__(self, continuation: list[int]) -> None:
        self._continuation = continuation
        self._position = 0

    def propose(self, k: int) -> Proposal:
        tokens = self._continuation[self._position : self._position + k]
        return Proposal(tuple(tokens), tuple(1.0 for _ in tokens))

    def extend(self, token_ids: Sequence[int]) -> None:
        self._position += len(token_ids)


class FixedDraft:
    """Always proposes the same tokens, whatever the context."""

    name = "fixed"

    def __init__(self, tokens: Sequence[int], source: str = "") -> None:
        self.tokens = tuple(tokens)
        self.source = source  # the proposals' source label (settable between rounds)

    def start(self, prompt_ids: Sequence[int]) -> FixedDraft:
        return self

    def propose(self, k: int) -> Proposal:
        tokens = self.tokens[:k]
        return Proposal(tokens, tuple(1.0 for _ in tokens), source=self.source)

    def extend(self, token_ids: Sequence[int]) -> None:
        pass


def never_matching_kenlm(target: TargetModel, path: Path, avoid: set[int]) -> KenLMDraft:
    """A unigram ARPA whose best token is one the target's greedy outputs never contain."""
    vocab = range(len(target.tokenizer))
    banned = target.eos_token_ids | set(target.tokenizer.all_special_ids)
    token = next(t for t in vocab if t not in avoid and t not in banned)
    tiny.unigram_arpa(path, {token: 0.9}, vocab)
    return KenLMDraft.load(path, vocab_size=target.vocab_size)


def generate(
    target: TargetModel,
    draft,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 24,
    k: int = 4,
    enabled: bool = True,
    adaptive: bool = False,
    sampling: SamplingParams | None = None,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    breaker: BreakerSettings | None = None,
) -> Generation:
    engine = SpeculativeEngine(target, draft, breaker)
    generation = engine.start(
        prompt_ids,
        sampling=sampling or SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, stop=stop, ignore_eos=ignore_eos),
        speculation=SpeculationParams(enabled=enabled, num_draft_tokens=k, adaptive=adaptive),
    )
    return generation


def fail_passes_fed(monkeypatch, poison: int) -> None:
    """Make every forward pass that feeds `poison` first in a row raise (a kernel failure).

    A round feeds its pending token first (after the prompt's tail, in a first round that
    prefills it: `skips`), so a request whose prompt ends in `poison` fails from its first
    round on, and a batched pass that holds it fails as a whole.
    """
    original = TargetModel.forward

    def failing_forward(self, cache, lengths, token_rows, **options):  # type: ignore[no-untyped-def]
        skips = options.get("skips") or [0] * len(token_rows)
        if any(row[skip] == poison for row, skip in zip(token_rows, skips, strict=True)):
            raise RuntimeError("simulated kernel failure")
        return original(self, cache, lengths, token_rows, **options)

    monkeypatch.setattr(TargetModel, "forward", failing_forward)

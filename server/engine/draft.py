"""The draft interface: anything that proposes the next few target token ids cheaply."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class Proposal:
    """Up to k drafted token ids.

    probs are the draft's own confidences (for gating, metrics and the breaker). A deterministic
    draft such as KenLM proposes tokens, not a distribution, so its q is one-hot and the
    verification rule needs nothing more. A draft that samples from a distribution (a neural or a
    sampled n-gram draft) must also fill `distributions` ([len(token_ids), vocab] q rows) so the
    full rule with the residual (p - q)+ can be applied (Leviathan et al. 2023, Alg. 1).
    """

    token_ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    distributions: torch.Tensor | None = field(default=None, compare=False)
    # Where the proposal came from ("kenlm", "context:3", ...): acceptance is tracked per
    # source, because sources differ far more than rounds of one source do.
    source: str = ""
    # Other chains from other sources, for the caller to choose among by their sources' measured
    # acceptance (Speculator.propose); empty for a single-source draft.
    alternatives: tuple[Proposal, ...] = field(default=(), compare=False)
    # A token tree (engine.token_tree): node i is a child of node parents[i] (-1: of the
    # pending token), parents before children; probs are then each node's path probability and
    # node_sources who proposed it. Empty for a chain, where each token follows the one before.
    parents: tuple[int, ...] = ()
    node_sources: tuple[str, ...] = field(default=(), compare=False)

    def __len__(self) -> int:
        return len(self.token_ids)


class DraftSession(Protocol):
    """Per-generation draft state, fed every accepted token (incremental, never rebuilt)."""

    def propose(self, k: int) -> Proposal: ...

    def extend(self, token_ids: Sequence[int]) -> None: ...


class Draft(Protocol):
    """A draft model shared by all generations; `start` makes one generation's session."""

    @property
    def name(self) -> str: ...

    def start(self, prompt_ids: Sequence[int]) -> DraftSession: ...

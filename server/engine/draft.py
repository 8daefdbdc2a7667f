"""The draft interfaces: anything that proposes the next few target token ids cheaply.

A draft session offers candidate chains each round (`Candidates`, best first); the speculator
alone turns them into the round's `DraftTree` (the best chain, or a token tree over all of
them). Every ability a session may have is declared here:

- `DraftSession`: `propose` and `extend`, and `branching()`, the way a token tree may branch
  below any node (None for a session that offers chains only); `observe`, the target's hidden
  state for a session that drafts from it (a learned head: `wants_features`);
- `StaticSession`: a static draft's (KenLM's) session, which a context draft also asks for a
  chain behind another gate, its n-best next tokens and a chain after given tokens.

A session class that subclasses a protocol inherits its defaults (`branching` -> None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kenspec.server.engine.draft_tree import Source

UNNAMED = Source("")  # the source of a chain from a draft that does not name one


@dataclass(frozen=True, slots=True)
class Chain:
    """One candidate continuation: each token follows the one before.

    `confidences` are the draft's own per token (KenLM's n-gram probability, 1.0 for a copied
    match): a deterministic draft proposes tokens, not a distribution, so verification needs
    nothing more. `source` is who proposed it, the bucket its acceptance is learned in;
    `token_sources`, where given, label each token apart (a token tree learns KenLM's tokens
    per n-gram probability decile).

    Example: KenLM's two tokens after "the", as a tree labels them:

        Chain((5, 7), (0.62, 0.31), Source("kenlm"), (Source("ngram", 6), Source("ngram", 3)))
    """

    tokens: tuple[int, ...] = ()
    confidences: tuple[float, ...] = ()
    source: Source = UNNAMED
    token_sources: tuple[Source, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    def labels(self) -> tuple[Source, ...]:
        """The source of each token: `token_sources`, else `source` for every one."""
        return self.token_sources or (self.source,) * len(self.tokens)


Candidates = tuple[Chain, ...]
"""A session's chains for one round, best first (the first may be empty; the others are not)."""


class Branching(Protocol):
    """Where a token tree may branch below any node (the target's recycled predictions)."""

    @property
    def root_token(self) -> int:
        """The stream's last token (the pending one): the tree's root."""
        ...

    def expand(self, token: int) -> list[tuple[int, Source]]:
        """Candidate children (token, source) of a node whose token is `token`, best first."""
        ...


class DraftSession(Protocol):
    """Per-generation draft state, fed every accepted token (incremental, never rebuilt)."""

    def propose(self, k: int) -> Candidates:
        """This round's candidate chains, best first: up to k tokens each (a chain after a
        long exact match may hold more; the speculator cuts to the round's cap)."""
        ...

    def extend(self, token_ids: Sequence[int]) -> None: ...

    def branching(self) -> Branching | None:
        """How a token tree may branch below its nodes; None: the chains alone."""
        return None

    def copies(self, k: int, min_match: int) -> Candidates:
        """The chains that continue an exact match of at least `min_match` tokens (the
        request's own context, past answers), longest match first; none by default (a session
        that offers copies says when it may, `may_copy`: by default it may not)."""
        return ()

    def may_copy(self, min_match: int) -> bool:
        """Whether `copies(k, min_match)` may find a chain now: a check cheap enough for every
        round (a session that copies says when it may; False: it would find none)."""
        return False

    @property
    def wants_features(self) -> bool:
        """Whether it drafts from the target's hidden states (`observe`); False: never."""
        return False

    def observe(self, feature: torch.Tensor) -> None:
        """The target's final hidden state at the row that chose the last token extended."""
        return None


class StaticSession(DraftSession, Protocol):
    """A static draft's session (KenLM): what a context draft asks of it besides `propose`."""

    def chain(self, k: int, min_prob: float | None = None) -> Chain:
        """Up to k tokens, gated at `min_prob` (None: the draft's own gate)."""
        ...

    def n_best(self, n: int) -> list[tuple[int, float]]:
        """The n most likely next tokens now and their probabilities, best first."""
        ...

    def chain_after(self, drafted: Sequence[int], k: int) -> Chain:
        """The chain as if `drafted` were already accepted (the session is not changed)."""
        ...


class Draft(Protocol):
    """A draft model shared by all generations; `start` makes one generation's session."""

    @property
    def name(self) -> str: ...

    def start(self, prompt_ids: Sequence[int]) -> DraftSession: ...


class StaticDraft(Protocol):
    """A draft whose sessions are static sessions (KenLM): what a context draft combines."""

    @property
    def name(self) -> str: ...

    def start(self, prompt_ids: Sequence[int]) -> StaticSession: ...

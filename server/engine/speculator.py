"""Per-generation drafting policy: how many tokens to draft this round, and whether to at all."""

from __future__ import annotations

from collections.abc import Sequence

from server.engine.breaker import AcceptanceBreaker, DraftFaultBreaker
from server.engine.draft import DraftSession, Proposal
from server.engine.params import SpeculationParams
from server.engine.rounds import BreakerState

_NOTHING = Proposal()
PROBE_AFTER = 16


class Speculator:
    """Drafts through the breakers and adapts the draft length k to recent acceptance.

    Adaptive k follows transformers' "heuristic" schedule: +2 after a fully accepted round,
    -1 after a rejection, within [1, num_draft_tokens].
    """

    def __init__(
        self,
        session: DraftSession | None,
        params: SpeculationParams,
        *,
        acceptance: AcceptanceBreaker | None = None,
        faults: DraftFaultBreaker | None = None,
        request_id: str = "",
    ) -> None:
        self._session = session if params.enabled else None
        self._params = params
        self._acceptance = acceptance
        self._faults = faults
        self._request_id = request_id
        self.k = params.num_draft_tokens
        self._starved = 0  # consecutive rounds whose drafts a batch cut entirely

    @property
    def breaker_state(self) -> BreakerState:
        return self._acceptance.state if self._acceptance else BreakerState.CLOSED

    @property
    def window_acceptance(self) -> float:
        return self._acceptance.window_acceptance if self._acceptance else 0.0

    def acceptance_estimate(self, prior: float = 1.0) -> float:
        """Per-token acceptance to expect of the next round, for a batch choosing its width:
        what a full window implies; `prior` (the draft's recent acceptance over all requests)
        until the window is full; 1.0 every PROBE_AFTER rounds in a row that a batch cut all
        its drafts (a stale estimate is re-measured once the batch can afford a wider pass)."""
        if self._starved and self._starved % PROBE_AFTER == 0:
            return 1.0
        if self._acceptance is None or not self._acceptance.window_full:
            return prior
        return self._acceptance.window_effective_acceptance

    def cut(self, proposed: int, kept: int) -> None:
        """A batch kept `kept` of this round's `proposed` drafts."""
        self._starved = self._starved + 1 if proposed and not kept else 0

    def propose(self, limit: int) -> Proposal:
        """At most min(k, limit) draft tokens; none when speculation is off or not paying."""
        if self._session is None or limit <= 0:
            return _NOTHING
        if self._acceptance is not None and not self._acceptance.allows_speculation():
            return _NOTHING
        k = min(self.k, limit)
        if self._faults is None:
            return self._session.propose(k)
        return self._faults.propose(self._session, k, self._request_id) or _NOTHING

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if self._acceptance is not None:
            self._acceptance.record(drafted, accepted)
        if self._params.adaptive:
            grown = self.k + 2 if accepted == drafted else self.k - 1
            self.k = max(1, min(self._params.num_draft_tokens, grown))

    def extend(self, token_ids: Sequence[int]) -> None:
        if self._session is not None:
            self._session.extend(token_ids)

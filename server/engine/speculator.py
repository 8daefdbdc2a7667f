"""Per-generation drafting policy: how many tokens to draft this round, and whether to at all."""

from __future__ import annotations

from collections.abc import Sequence

from server.engine.breaker import AcceptanceBreaker, DraftFaultBreaker
from server.engine.draft import DraftSession, Proposal
from server.engine.params import SpeculationParams
from server.engine.rounds import BreakerState

_NOTHING = Proposal()
PROBE_AFTER = 16  # starved rounds before the first re-probe; doubles after each failed probe
PROBE_AFTER_MAX = 256


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
        self._probe_every = PROBE_AFTER
        self._probing = False

    @property
    def breaker_state(self) -> BreakerState:
        return self._acceptance.state if self._acceptance else BreakerState.CLOSED

    @property
    def window_acceptance(self) -> float:
        return self._acceptance.window_acceptance if self._acceptance else 0.0

    def acceptance_estimate(self, prior: float = 1.0) -> float:
        """Per-token acceptance to expect of the next round, for a batch choosing its width:
        what a full window implies; `prior` (the draft's recent acceptance over all requests)
        until the window is full. After `probe_every` rounds in a row whose drafts a batch cut
        entirely, 1.0 once (a probe: a stale estimate is re-measured); a probe that fails
        doubles the wait for the next one (up to PROBE_AFTER_MAX), one that pays resets it."""
        if self._probe_due:
            return 1.0
        if self._acceptance is None or not self._acceptance.window_full:
            return prior
        return self._acceptance.window_effective_acceptance

    @property
    def _probe_due(self) -> bool:
        return self._starved > 0 and self._starved % self._probe_every == 0

    def cut(self, proposed: int, kept: int) -> None:
        """A batch kept `kept` of this round's `proposed` drafts."""
        if kept and self._probe_due:
            self._probing = True
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
        if self._probing:  # a probe pays when at least half its drafts were accepted
            self._probing = False
            failed = 2 * accepted < drafted
            self._probe_every = (
                min(2 * self._probe_every, PROBE_AFTER_MAX) if failed else PROBE_AFTER
            )
        if self._acceptance is not None:
            self._acceptance.record(drafted, accepted)
        if self._params.adaptive:
            grown = self.k + 2 if accepted == drafted else self.k - 1
            self.k = max(1, min(self._params.num_draft_tokens, grown))

    def extend(self, token_ids: Sequence[int]) -> None:
        if self._session is not None:
            self._session.extend(token_ids)

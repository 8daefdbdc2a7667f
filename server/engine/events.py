"""What the engine reports as it runs (pass sizes, reused prompt positions, breaker
transitions), to an observer given at construction: the service's metrics, or nobody."""

from __future__ import annotations

from typing import Protocol

from kenspec.api.outputs import BreakerState


class EngineEvents(Protocol):
    def observe_pass(self, rows: int, tokens: int) -> None:
        """A forward pass verified `rows` streams with `tokens` tokens in all."""

    def observe_reuse(self, tokens: int) -> None:
        """`tokens` prompt positions were copied from the prefix cache, not computed."""

    def observe_transition(self, scope: str, state: BreakerState) -> None:
        """A breaker (scope "request" or "draft") moved to `state`."""

    def observe_round_work(self, seconds: float, drafted: bool) -> None:
        """A round spent `seconds` outside its forward pass (drafting, choosing, walking,
        delivery); `drafted`: its pass verified drafts."""


class NoEvents:
    """An observer that ignores everything."""

    def observe_pass(self, rows: int, tokens: int) -> None:
        pass

    def observe_reuse(self, tokens: int) -> None:
        pass

    def observe_transition(self, scope: str, state: BreakerState) -> None:
        pass

    def observe_round_work(self, seconds: float, drafted: bool) -> None:
        pass


NO_EVENTS = NoEvents()

"""Per-request statistics the CLI prints after a stream: speed, acceptance, mode switches."""

from __future__ import annotations

from dataclasses import dataclass

from .results import Round


@dataclass(slots=True)
class StreamStats:
    """Accumulates rounds as they arrive; the server's final usage wins where it is sent."""

    started: float  # time.perf_counter() when the request was sent
    last_seen: float = 0.0
    rounds: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    mode_switches: int = 0
    last_mode: str | None = None
    finish_reason: str | None = None

    def observe(self, round_: Round, now: float) -> None:
        self.last_seen = now
        self.rounds += 1
        self.tokens += len(round_.token_ids)
        self.drafted += round_.drafted
        self.accepted += round_.accepted
        # A switch is the breaker moving the request between speculative and plain decoding.
        if self.last_mode is not None and round_.mode != self.last_mode:
            self.mode_switches += 1
        self.last_mode = round_.mode
        if round_.finish_reason is not None:
            self.finish_reason = round_.finish_reason
        if round_.usage is not None:
            self.tokens = round_.usage.completion_tokens
            self.drafted = round_.usage.drafted_tokens
            self.accepted = round_.usage.accepted_tokens
            self.rounds = round_.usage.rounds

    def summary(self) -> str:
        """One line, e.g. ``completion_tokens=12 tokens/s=40.1 acceptance=6/8 (75.0%) ...``."""
        elapsed = self.last_seen - self.started
        rate = f"{self.tokens / elapsed:.1f}" if elapsed > 0 else "n/a"
        share = f" ({self.accepted / self.drafted:.1%})" if self.drafted else ""
        return (
            f"completion_tokens={self.tokens} tokens/s={rate} "
            f"acceptance={self.accepted}/{self.drafted}{share} rounds={self.rounds} "
            f"mode_switches={self.mode_switches} finish_reason={self.finish_reason or 'none'}"
        )

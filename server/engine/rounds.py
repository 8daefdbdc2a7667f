"""What one verification round reports."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Mode(Enum):
    SPECULATIVE = "speculative"
    AUTOREGRESSIVE = "autoregressive"


class FinishReason(Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    rounds: int
    seed: int


@dataclass(frozen=True, slots=True)
class Round:
    """One verification: the tokens it added to the output and how the draft did.

    accepted counts draft tokens the target agreed with that made it into the output; the round
    also adds one token of the target's own unless a stop condition cut it off earlier.
    """

    index: int
    token_ids: tuple[int, ...]
    text: str
    drafted: int
    accepted: int
    mode: Mode
    breaker_state: BreakerState
    window_acceptance: float
    finish_reason: FinishReason | None = None
    usage: Usage | None = None

"""What a verification round reports: one vocabulary for the engine, the service and the client.

The enum values are the lowercase proto names without their prefix (``ROUND_MODE_SPECULATIVE``
is ``"speculative"``), so a value compares equal to its label: ``Mode.SPECULATIVE ==
"speculative"``. Plain Python: importing this pulls in neither protobuf nor gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Mode(StrEnum):
    """How a round was decoded: drafts verified, or one token of the target's own."""

    SPECULATIVE = "speculative"
    AUTOREGRESSIVE = "autoregressive"


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class FinishReason(StrEnum):
    EOS = "eos"
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"
    TOOL_CALLS = "tool_calls"  # the answer ended after calling tools (server.tool_calls)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the distribution it was chosen from (after
    the request's processors and, when sampling, its temperature, top-k, top-p and min-p), and
    the `top` most likely tokens there as (token id, logprob), best first; tokens that
    distribution rules out (probability 0) are never among them.

    Example: ``TokenLogprob(504, -0.11, ((504, -0.11), (30, -2.3)))``.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """A finished request's totals."""

    prompt_tokens: int
    completion_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    rounds: int
    seed: int

    @property
    def acceptance(self) -> float | None:
        """accepted / drafted over the request; None when nothing was drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

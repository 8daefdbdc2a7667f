"""Value types for what the server streams back: `Round` and `Completion`, with the shared
`Usage` and enums of `kenspec_api.outputs`.

Enum values are string enums that equal their lowercase labels (``round.mode ==
"speculative"``), so callers need not import the generated module; each `Round` keeps the raw
response for anyone who needs more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kenspec_api import generator_pb2 as pb
from kenspec_api.convert import from_proto, usage_from_proto
from kenspec_api.outputs import BreakerState, FinishReason, Mode, Usage

from .errors import ProtocolError


@dataclass(frozen=True, slots=True)
class Round:
    """One verification round as streamed; `finish_reason`/`usage` only on the last."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    index: int
    drafted: int
    accepted: int
    mode: Mode | str  # a str only for a value this client does not know
    breaker_state: BreakerState | str
    window_acceptance: float
    finish_reason: FinishReason | str | None  # None before the last round
    usage: Usage | None
    draft_source: str  # "kenlm", "context:4", "suffix:8", "recycled", ...; "" if none drafted
    response: pb.GenerateResponse = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, response: pb.GenerateResponse) -> Round:
        info = response.round
        finish = response.finish_reason
        return cls(
            request_id=response.request_id,
            token_ids=tuple(response.token_ids),
            text=response.text,
            index=info.index,
            drafted=info.drafted,
            accepted=info.accepted,
            mode=from_proto(Mode, info.mode),
            breaker_state=from_proto(BreakerState, info.breaker_state),
            window_acceptance=info.window_acceptance,
            finish_reason=from_proto(FinishReason, finish) if finish else None,
            usage=usage_from_proto(response.usage) if response.HasField("usage") else None,
            draft_source=info.draft_source,
            response=response,
        )


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation: the joined text and token ids, why it ended, and its usage."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | str
    usage: Usage
    rounds: tuple[Round, ...] = field(repr=False)


def completion_from_rounds(rounds: list[Round], address: str) -> Completion:
    """Join a finished stream; ``ProtocolError`` if the last round carries no finish/usage."""
    last = rounds[-1] if rounds else None
    if last is None or last.finish_reason is None or last.usage is None:
        raise ProtocolError(None, "the stream ended without a finish_reason and usage", address)
    return Completion(
        request_id=last.request_id,
        text="".join(r.text for r in rounds),
        token_ids=tuple(token for r in rounds for token in r.token_ids),
        finish_reason=last.finish_reason,
        usage=last.usage,
        rounds=tuple(rounds),
    )

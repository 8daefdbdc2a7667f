"""Value types for what the server streams back: `Round`, `Usage`, `Completion`.

Enum values become short lowercase labels ("speculative", "eos") so callers need not import
the generated module; each `Round` keeps the raw response for anyone who needs more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from .api import generator_pb2 as pb
from .errors import ProtocolError


@dataclass(frozen=True, slots=True)
class Usage:
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

    @classmethod
    def from_proto(cls, usage: pb.Usage) -> Usage:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            drafted_tokens=usage.drafted_tokens,
            accepted_tokens=usage.accepted_tokens,
            rounds=usage.rounds,
            seed=usage.seed,
        )


@dataclass(frozen=True, slots=True)
class Round:
    """One verification round as streamed; `finish_reason`/`usage` only on the last."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    index: int
    drafted: int
    accepted: int
    mode: str  # "speculative", "autoregressive" or "unspecified"
    breaker_state: str  # "closed", "open", "half_open" or "unspecified"
    window_acceptance: float
    finish_reason: str | None  # "eos", "length", "stop_sequence"; None before the last round
    usage: Usage | None
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
            mode=enum_label(pb.RoundMode, info.mode, "ROUND_MODE_"),
            breaker_state=enum_label(pb.BreakerState, info.breaker_state, "BREAKER_STATE_"),
            window_acceptance=info.window_acceptance,
            finish_reason=enum_label(pb.FinishReason, finish, "FINISH_REASON_") if finish else None,
            usage=Usage.from_proto(response.usage) if response.HasField("usage") else None,
            response=response,
        )


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation: the joined text and token ids, why it ended, and its usage."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    rounds: tuple[Round, ...] = field(repr=False)


def enum_label(enum: EnumTypeWrapper, value: int, prefix: str) -> str:
    """``enum_label(pb.RoundMode, 1, "ROUND_MODE_") == "speculative"``; unknown values -> str."""
    try:
        return enum.Name(value).removeprefix(prefix).lower()
    except ValueError:  # a value from a newer server than this client
        return str(value)


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

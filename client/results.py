"""Value types for what the server streams back: `Round` and `Completion`, with the shared
`Usage` and enums of `kenspec_api.outputs`.

Enum values are string enums that equal their lowercase labels (``round.mode ==
"speculative"``), so callers need not import the generated module; each `Round` keeps the raw
response for anyone who needs more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kenspec.api import generator_pb2 as pb
from kenspec.api.convert import from_proto, usage_from_proto
from kenspec.api.outputs import BreakerState, FinishReason, Mode, Usage

from .errors import ProtocolError


@dataclass(frozen=True, slots=True)
class Alternative:
    """A token the target could have chosen there, and its log-probability."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class Logprob:
    """A generated token's log-probability under the distribution it was chosen from, with
    the most likely alternatives (best first) when the request asked for them."""

    token_id: int
    token: str
    logprob: float
    top: tuple[Alternative, ...]

    @classmethod
    def from_proto(cls, logprob: pb.TokenLogprob) -> Logprob:
        return cls(
            token_id=logprob.token_id,
            token=logprob.token,
            logprob=logprob.logprob,
            top=tuple(Alternative(t.token_id, t.token, t.logprob) for t in logprob.top_logprobs),
        )


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made (a request with tools): `arguments` is JSON text. In a Round, a
    piece of one: its first piece has the id and name, the next ones more arguments."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Round:
    """One verification round as streamed; `finish_reason`/`usage` only on the last (of its
    choice: with n > 1 the choices' rounds interleave, each saying its `choice_index`)."""

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
    choice_index: int = 0
    logprobs: tuple[Logprob, ...] = ()  # one per token, when the request asked for them
    tool_calls: tuple[ToolCall, ...] = ()  # pieces of calls this round wrote (with tools)

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
            choice_index=response.choice_index,
            logprobs=tuple(Logprob.from_proto(logprob) for logprob in response.logprobs),
            tool_calls=tuple(
                ToolCall(call.index, call.id, call.name, call.arguments)
                for call in response.tool_calls
            ),
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
    choice_index: int = 0
    logprobs: tuple[Logprob, ...] = ()  # one per token, when the request asked for them
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the model made, whole (with tools)


def joined_calls(rounds: Sequence[Round]) -> tuple[ToolCall, ...]:
    """The rounds' call pieces joined into whole calls, by index."""
    calls: dict[int, ToolCall] = {}
    for round_ in rounds:
        for piece in round_.tool_calls:
            whole = calls.get(piece.index)
            if whole is None:
                calls[piece.index] = piece
            else:
                calls[piece.index] = replace(whole, arguments=whole.arguments + piece.arguments)
    return tuple(calls[index] for index in sorted(calls))


def completions_from_rounds(rounds: list[Round], address: str) -> list[Completion]:
    """Join a finished stream into one Completion per choice, by choice index; ``ProtocolError``
    if a choice's last round carries no finish/usage."""
    by_choice: dict[int, list[Round]] = {}
    for round_ in rounds:
        by_choice.setdefault(round_.choice_index, []).append(round_)
    if not by_choice:
        raise ProtocolError(None, "the stream ended without a finish_reason and usage", address)
    completions = []
    for index in sorted(by_choice):
        own = by_choice[index]
        last = own[-1]
        if last.finish_reason is None or last.usage is None:
            raise ProtocolError(None, "the stream ended without a finish_reason and usage", address)
        completions.append(
            Completion(
                request_id=last.request_id,
                text="".join(r.text for r in own),
                token_ids=tuple(token for r in own for token in r.token_ids),
                finish_reason=last.finish_reason,
                usage=last.usage,
                rounds=tuple(own),
                choice_index=index,
                logprobs=tuple(logprob for r in own for logprob in r.logprobs),
                tool_calls=joined_calls(own),
            )
        )
    return completions

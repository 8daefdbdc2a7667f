"""The one mapping between the `outputs` vocabulary and the protobuf messages and enums.

Each enum of `outputs` maps to the proto enum of the same members with a prefix
(``Mode.SPECULATIVE`` <-> ``ROUND_MODE_SPECULATIVE``); value 0 of each proto enum is
``*_UNSPECIFIED``, which no server sends.
"""

from __future__ import annotations

from dataclasses import fields
from enum import StrEnum

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from kenspec.api import generator_pb2 as pb
from kenspec.api.outputs import BreakerState, FinishReason, Mode, Usage

_PROTO_ENUMS: dict[type[StrEnum], tuple[EnumTypeWrapper, str]] = {
    Mode: (pb.RoundMode, "ROUND_MODE_"),
    BreakerState: (pb.BreakerState, "BREAKER_STATE_"),
    FinishReason: (pb.FinishReason, "FINISH_REASON_"),
}


# Usage's fields are pb.Usage's, by name (tests/client checks the two agree).
_USAGE_FIELDS = tuple(field.name for field in fields(Usage))


def to_proto(member: StrEnum) -> int:
    """``to_proto(Mode.SPECULATIVE) == pb.ROUND_MODE_SPECULATIVE``."""
    enum, prefix = _PROTO_ENUMS[type(member)]
    return enum.Value(prefix + member.name)


def from_proto(kind: type[StrEnum], value: int) -> StrEnum | str:
    """``from_proto(Mode, pb.ROUND_MODE_SPECULATIVE) is Mode.SPECULATIVE``; a value this client
    does not know (from a newer server, or UNSPECIFIED) comes back as its lowercase label or
    number, never as an error."""
    enum, prefix = _PROTO_ENUMS[kind]
    try:
        name = enum.Name(value).removeprefix(prefix)
    except ValueError:
        return str(value)
    return kind[name] if name in kind.__members__ else name.lower()


def usage_to_proto(usage: Usage) -> pb.Usage:
    return pb.Usage(**{name: getattr(usage, name) for name in _USAGE_FIELDS})


def usage_from_proto(usage: pb.Usage) -> Usage:
    return Usage(**{name: getattr(usage, name) for name in _USAGE_FIELDS})

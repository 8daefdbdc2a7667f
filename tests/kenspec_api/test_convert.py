"""The one output vocabulary and its mapping to the proto: every member round-trips, and a value
a client does not know comes back as a label, never as an error."""

from __future__ import annotations

import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.api.convert import from_proto, to_proto, usage_from_proto, usage_to_proto
from kenspec.api.outputs import BreakerState, FinishReason, Mode, Usage


@pytest.mark.parametrize("member", [*Mode, *BreakerState, *FinishReason])
def test_every_member_round_trips_and_equals_its_proto_label(member) -> None:
    value = to_proto(member)
    assert value != 0  # never *_UNSPECIFIED
    assert from_proto(type(member), value) is member
    assert member == member.name.lower()


def test_every_proto_value_but_unspecified_has_a_member() -> None:
    for kind, enum in ((Mode, pb.RoundMode), (BreakerState, pb.BreakerState)):
        named = {from_proto(kind, value) for value in enum.values() if value != 0}
        assert named == set(kind)
    assert {from_proto(FinishReason, v) for v in pb.FinishReason.values() if v} == set(FinishReason)


def test_unknown_and_unspecified_values_become_labels() -> None:
    assert from_proto(Mode, 99) == "99"
    assert from_proto(Mode, pb.ROUND_MODE_UNSPECIFIED) == "unspecified"


def test_usage_round_trips_through_the_proto() -> None:
    usage = Usage(
        prompt_tokens=5, completion_tokens=7, drafted_tokens=9, accepted_tokens=4, rounds=3, seed=11
    )
    assert usage_from_proto(usage_to_proto(usage)) == usage
    assert usage.acceptance == pytest.approx(4 / 9)

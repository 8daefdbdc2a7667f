"""The client's trace context: an explicit traceparent, the current OpenTelemetry span's, or
nothing; and the client never needs (nor imports on its own) OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from kenspec.client.trace_context import trace_metadata

ROOT = Path(__file__).resolve().parents[2]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

# A fresh interpreter: importing and calling the client loads no OpenTelemetry; with it not
# installed at all, nothing is sent unless a traceparent is given.
CHECK = f"""
import sys
import kenspec.client
from kenspec.client.trace_context import trace_metadata
assert trace_metadata() == ()
loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
assert not loaded, loaded
sys.modules["opentelemetry"] = None  # as if not installed
assert trace_metadata() == ()
assert trace_metadata({TRACEPARENT!r}) == (("traceparent", {TRACEPARENT!r}),)
"""


def test_needs_no_opentelemetry() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


def test_sends_the_current_span() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("caller") as span:
        sent = dict(trace_metadata())
    context = span.get_span_context()
    assert sent["traceparent"] == (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    )
    assert trace_metadata() == ()  # no span active


def test_an_explicit_traceparent_wins() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("caller"):
        assert trace_metadata(TRACEPARENT) == (("traceparent", TRACEPARENT),)


@pytest.mark.parametrize(
    "traceparent",
    [
        "",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ],
)
def test_a_malformed_traceparent_is_refused(traceparent: str) -> None:
    with pytest.raises(ValueError, match="W3C traceparent"):
        trace_metadata(traceparent)

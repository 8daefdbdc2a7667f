"""Trace context for the client's calls, so that a server started with --otel records its span
of a call as a child of the caller's.

OpenTelemetry is optional and the client never imports it on its own: an application with an
active span has imported it already, and only then is its current context injected, through
the application's configured propagator (W3C traceparent/tracestate unless it chose another).
An explicit `traceparent` is sent as given instead.
"""

from __future__ import annotations

import re
import sys

from .channel import Pairs

# W3C Trace Context: version-trace_id-parent_id-flags, lowercase hex.
_TRACEPARENT = re.compile(
    r"[0-9a-f]{2}-(?P<trace>[0-9a-f]{32})-(?P<parent>[0-9a-f]{16})-[0-9a-f]{2}"
)


def trace_metadata(traceparent: str | None = None) -> Pairs:
    """The trace context to send with a call: `traceparent` when given (ValueError if it is not
    a W3C traceparent), else the current OpenTelemetry context, else nothing.

    >>> trace_metadata("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    (('traceparent', '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'),)
    """
    if traceparent is not None:
        check_traceparent(traceparent)
        return (("traceparent", traceparent),)
    if "opentelemetry.context" not in sys.modules:  # no span can be active: nothing to send
        return ()
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple((key.lower(), value) for key, value in carrier.items())


def check_traceparent(traceparent: str) -> None:
    match = _TRACEPARENT.fullmatch(traceparent)
    if (
        match is None
        or traceparent.startswith("ff")  # a version W3C reserves as invalid
        or set(match["trace"]) == {"0"}
        or set(match["parent"]) == {"0"}
    ):
        raise ValueError(
            "traceparent must be a W3C traceparent, 00-<32 hex trace id>-<16 hex parent span "
            f"id>-<2 hex flags> (ids not all zeros), not {traceparent!r}"
        )

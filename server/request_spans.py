"""What request tracing offers the APIs: one span per generate call (gRPC Generate, HTTP
completions), and tracing off.

The APIs ask a `Tracing` for a `RequestSpan` when a call's record starts; the record reports
each round and the call's final status to it. With tracing off (the default) that is
`NO_TRACING`, whose spans do nothing and which never imports OpenTelemetry. `server.otel` is
the OpenTelemetry implementation, which `server.tracing.build_tracing` loads with `--otel`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import grpc

from kenspec.server.engine.events import EngineEvents
from kenspec.server.engine.generation import Round

OTEL_INSTALL = "pip install 'kenspec[otel]'"

# What a call's trace context arrives in: gRPC invocation metadata ((key, value) pairs) or
# HTTP headers (a mapping); W3C traceparent/tracestate are read from it.
Carrier = Mapping[str, str] | Iterable[tuple[str, str | bytes]] | None


class TracingUnavailable(ValueError):
    """--otel was asked for, but the OpenTelemetry packages are not installed."""

    def __init__(self, missing: str, install: str = OTEL_INSTALL) -> None:
        super().__init__(
            f"--otel needs the OpenTelemetry packages ({missing} is missing): {install}, "
            "or start without --otel"
        )


class RequestSpan(Protocol):
    def round(self, round_: Round) -> None:
        """The call's next round, as the client receives it."""

    def end(self, code: grpc.StatusCode) -> None:
        """The call ended with `code` (gRPC status names for both APIs, as in the metrics)."""


class Tracing(Protocol):
    def request_span(self, api: str, name: str, request_id: str, carrier: Carrier) -> RequestSpan:
        """A span for one generate call, a child of the caller's trace context if it sent one."""

    def engine_events(self, events: EngineEvents) -> EngineEvents:
        """`events`, plus the draft-fault breaker's transitions on the open request spans."""

    def close(self) -> None:
        """Export what is left; called once the server has stopped."""


class _NoSpan:
    def round(self, round_: Round) -> None:
        pass

    def end(self, code: grpc.StatusCode) -> None:
        pass


NO_SPAN = _NoSpan()


class NoTracing:
    """Tracing off: every span is NO_SPAN, the engine's events go straight through."""

    def request_span(self, api: str, name: str, request_id: str, carrier: Carrier) -> RequestSpan:
        return NO_SPAN

    def engine_events(self, events: EngineEvents) -> EngineEvents:
        return events

    def close(self) -> None:
        pass


NO_TRACING = NoTracing()

"""Request tracing: one span per generate call (gRPC Generate, HTTP completions), off by
default.

The APIs ask a `Tracing` for a `RequestSpan` when a call's record starts; the record reports
each round and the call's final status to it. With tracing off (the default) that is
`NO_TRACING`, whose spans do nothing and which never imports OpenTelemetry. With `--otel`,
`build_tracing` loads `server.otel`, which needs the `otel` extra.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Protocol

import grpc

from server.engine.events import EngineEvents
from server.engine.generation import Round

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


def build_tracing(
    enabled: bool, service_name: str, model: str, environ: Mapping[str, str] | None = None
) -> Tracing:
    """NO_TRACING unless `enabled`; else spans exported as the standard OTEL_* variables say
    (OTLP to OTEL_EXPORTER_OTLP_ENDPOINT by default). TracingUnavailable (a ValueError, so a
    clear start-up error) when the packages are missing."""
    if not enabled:
        return NO_TRACING
    try:
        from server import otel
    except ImportError as error:
        if not (error.name or "").startswith("opentelemetry"):
            raise
        raise TracingUnavailable(error.name or "opentelemetry") from None
    environ = os.environ if environ is None else environ
    name = service_name or environ.get("OTEL_SERVICE_NAME") or "kenspec"
    return otel.OtelTracing(otel.tracer_provider(name, environ), model)

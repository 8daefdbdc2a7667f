"""Request spans with OpenTelemetry (loaded by server.tracing only with --otel; needs the
`otel` extra).

One SERVER span per generate call, a child of the trace context the client sent (W3C
traceparent/tracestate in gRPC metadata or HTTP headers, read by the globally configured
propagator). Attributes (kenspec.*): api, request_id, model at the start; status, finish_reason,
prompt_tokens, completion_tokens, drafted_tokens, accepted_tokens, rounds at the end. Events:
`round` per round (index, tokens, drafted, accepted, mode, draft_source) and `breaker` per
breaker transition (scope "request": the call's acceptance breaker, seen between its rounds;
scope "draft": the process-wide draft-fault breaker, on every call open when it moved).

Spans stay bounded: the first ROUND_EVENTS rounds and BREAKER_EVENTS transitions are events;
kenspec.round_events_dropped counts the rounds beyond. Together they stay under the SDK's
default of 128 events a span (OTEL_SPAN_EVENT_COUNT_LIMIT), beyond which it would drop the
oldest.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping

import grpc
from opentelemetry import propagate
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kenspec.api.outputs import BreakerState
from kenspec.server.engine.events import EngineEvents
from kenspec.server.engine.generation import Round
from kenspec.server.request_spans import Carrier, RequestSpan, TracingUnavailable

ROUND_EVENTS = 100
BREAKER_EVENTS = 16
# Not errors of the server: the call succeeded, or its client left.
_NOT_ERRORS = frozenset({grpc.StatusCode.OK, grpc.StatusCode.CANCELLED})
_OTLP_EXPORTERS = {  # OTEL_EXPORTER_OTLP_PROTOCOL -> the exporter's module, its package
    "grpc": (
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "pip install 'kenspec[otel]'",
    ),
    "http/protobuf": (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "pip install opentelemetry-exporter-otlp-proto-http",
    ),
}


def tracer_provider(service_name: str, environ: Mapping[str, str]) -> TracerProvider:
    """A provider exporting in batches to `span_exporter(environ)`; resource attributes from
    OTEL_RESOURCE_ATTRIBUTES, service.name `service_name`."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter(environ)))
    return provider


def span_exporter(environ: Mapping[str, str]) -> SpanExporter:
    """The exporter the standard variables ask for: OTEL_TRACES_EXPORTER otlp (the default) or
    console; OTLP over OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL grpc (the default) or
    http/protobuf. The OTLP exporter reads its endpoint, headers and TLS from OTEL_* itself."""
    kind = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "console":
        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: kenspec exports to 'otlp' or 'console'")
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if protocol not in _OTLP_EXPORTERS:
        raise ValueError(
            f"OTLP protocol {protocol!r}: kenspec exports over {' or '.join(_OTLP_EXPORTERS)}"
        )
    module_name, install = _OTLP_EXPORTERS[protocol]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise TracingUnavailable(module_name, install) from None
    return module.OTLPSpanExporter()


class OtelTracing:
    """kenspec.server.request_spans.Tracing with OpenTelemetry spans from `provider`."""

    def __init__(self, provider: TracerProvider, model: str) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("kenspec.server")
        self._model = model
        self._open: set[_RequestSpan] = set()  # spans not ended yet, for draft transitions
        self._lock = threading.Lock()  # the engine thread reads _open

    def request_span(self, api: str, name: str, request_id: str, carrier: Carrier) -> RequestSpan:
        attributes = {"kenspec.api": api, "kenspec.request_id": request_id}
        attributes["kenspec.model"] = self._model
        span = self._tracer.start_span(
            name,
            context=propagate.extract(_as_mapping(carrier)),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        request_span = _RequestSpan(span, self._forget)
        with self._lock:
            self._open.add(request_span)
        return request_span

    def engine_events(self, events: EngineEvents) -> EngineEvents:
        return _TracedEvents(events, self.draft_transition)

    def draft_transition(self, state: BreakerState) -> None:
        """The draft-fault breaker moved to `state`: an event on every call open now."""
        with self._lock:
            spans = list(self._open)
        for span in spans:
            span.breaker("draft", state)

    def close(self) -> None:
        self.provider.shutdown()

    def _forget(self, span: _RequestSpan) -> None:
        with self._lock:
            self._open.discard(span)


class _RequestSpan:
    """One call's span: round and breaker events as the rounds come, totals at the end."""

    def __init__(self, span: Span, on_end: Callable[[_RequestSpan], None]) -> None:
        self._span = span
        self._on_end: Callable[[_RequestSpan], None] | None = on_end
        self._rounds = self._tokens = self._drafted = self._accepted = 0
        self._breaker = BreakerState.CLOSED  # a request's acceptance breaker starts closed
        self._breaker_events = 0
        self._last: Round | None = None

    def round(self, round_: Round) -> None:
        if self._rounds < ROUND_EVENTS:
            self._span.add_event(
                "round",
                {
                    "index": round_.index,
                    "tokens": len(round_.token_ids),
                    "drafted": round_.drafted,
                    "accepted": round_.accepted,
                    "mode": round_.mode.value,
                    "draft_source": round_.source,
                },
            )
        self._rounds += 1
        self._tokens += len(round_.token_ids)
        self._drafted += round_.drafted
        self._accepted += round_.accepted
        if round_.breaker_state is not self._breaker:
            self.breaker("request", round_.breaker_state, round_.index)
            self._breaker = round_.breaker_state
        self._last = round_

    def breaker(self, scope: str, state: BreakerState, round_index: int | None = None) -> None:
        if self._breaker_events >= BREAKER_EVENTS:
            return
        self._breaker_events += 1  # the engine thread may race this: one event more at worst
        attributes: dict[str, str | int] = {"scope": scope, "state": state.value}
        if round_index is not None:
            attributes["round"] = round_index
        self._span.add_event("breaker", attributes)

    def end(self, code: grpc.StatusCode) -> None:
        if self._on_end is None:
            return  # ended already
        self._on_end(self)
        self._on_end = None
        self._span.set_attributes(self._totals(code))
        if code not in _NOT_ERRORS:
            self._span.set_status(Status(StatusCode.ERROR, code.name))
        self._span.end()

    def _totals(self, code: grpc.StatusCode) -> dict[str, str | int]:
        totals: dict[str, str | int] = {
            "kenspec.status": code.name,
            "kenspec.rounds": self._rounds,
            "kenspec.completion_tokens": self._tokens,
            "kenspec.drafted_tokens": self._drafted,
            "kenspec.accepted_tokens": self._accepted,
        }
        last = self._last
        if last is not None and last.finish_reason is not None:
            totals["kenspec.finish_reason"] = last.finish_reason.value
        if last is not None and last.usage is not None:
            totals["kenspec.prompt_tokens"] = last.usage.prompt_tokens
        if self._rounds > ROUND_EVENTS:
            totals["kenspec.round_events_dropped"] = self._rounds - ROUND_EVENTS
        return totals


class _TracedEvents:
    """The engine's events, passed on; the draft-fault breaker's transitions also to spans."""

    def __init__(self, events: EngineEvents, on_draft: Callable[[BreakerState], None]) -> None:
        self._events = events
        self._on_draft = on_draft

    def observe_pass(self, rows: int, tokens: int) -> None:
        self._events.observe_pass(rows, tokens)

    def observe_reuse(self, tokens: int) -> None:
        self._events.observe_reuse(tokens)

    def observe_round_work(self, seconds: float, drafted: bool) -> None:
        self._events.observe_round_work(seconds, drafted)

    def observe_transition(self, scope: str, state: BreakerState) -> None:
        self._events.observe_transition(scope, state)
        if scope == "draft":  # a request's own transitions are seen in its rounds
            self._on_draft(state)


def _as_mapping(carrier: Carrier) -> Mapping[str, str]:
    if carrier is None:
        return {}
    if isinstance(carrier, Mapping):
        return carrier
    return {key: value for key, value in carrier if isinstance(value, str)}

"""OpenTelemetry tracing (--otel): one span per generate call over gRPC and over HTTP, a child
of the caller's trace context, with the call's totals and its rounds as events; nothing at all
with tracing off. Spans are read from the SDK's in-memory exporter, put where the OTLP exporter
would be."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kenspec.api import generator_pb2 as pb
from kenspec.api.outputs import BreakerState, FinishReason, Mode
from kenspec.client import AsyncClient, InvalidRequest
from kenspec.server import otel
from kenspec.server.engine.generation import Round
from kenspec.server.request_spans import NO_TRACING

TIMEOUT = 60.0  # seconds; bounds waits that a passing run never reaches
ROOT = Path(__file__).resolve().parents[2]
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def exporter(monkeypatch) -> InMemorySpanExporter:
    """Where --otel servers started by the test export their spans."""
    memory = InMemorySpanExporter()
    monkeypatch.setattr(otel, "span_exporter", lambda environ: memory)
    return memory


async def finished_spans(server, exporter: InMemorySpanExporter, count: int) -> list:
    """The first `count` spans the server ended (an HTTP call's span ends just after its last
    byte is sent, so the response can arrive first)."""

    async def wait() -> list:
        while len(exporter.get_finished_spans()) < count:
            await asyncio.to_thread(server.tracing.provider.force_flush)
            await asyncio.sleep(0.01)
        return list(exporter.get_finished_spans())

    return await asyncio.wait_for(wait(), TIMEOUT)


def events(span: ReadableSpan, name: str) -> list[dict]:
    return [dict(event.attributes) for event in span.events if event.name == name]


async def test_grpc_call_is_a_child_span_of_the_bundled_clients_context(
    start_server, exporter
) -> None:
    # Spans (the operator's) always carry the draft source; the stream, with the flag.
    server, _ = await start_server(otel=True, report_draft_source=True)
    caller = TracerProvider().get_tracer("test-caller")
    async with AsyncClient(f"127.0.0.1:{server.port}") as client:
        with caller.start_as_current_span("caller") as parent:
            completion = await asyncio.wait_for(
                client.generate_text(
                    "The quick brown fox", max_new_tokens=16, ignore_eos=True, request_id="t-1"
                ),
                TIMEOUT,
            )
    [span] = await finished_spans(server, exporter, 1)
    assert span.name == "kenspec.v1.Generator/Generate"
    assert span.kind is SpanKind.SERVER
    assert span.context.trace_id == parent.get_span_context().trace_id
    assert span.parent.span_id == parent.get_span_context().span_id
    assert span.status.status_code is StatusCode.UNSET
    usage = completion.usage
    assert dict(span.attributes) == {
        "kenspec.api": "grpc",
        "kenspec.request_id": "t-1",
        "kenspec.model": Path(server.settings.model.model).name,
        "kenspec.status": "OK",
        "kenspec.finish_reason": "length",
        "kenspec.prompt_tokens": usage.prompt_tokens,
        "kenspec.completion_tokens": 16,
        "kenspec.drafted_tokens": usage.drafted_tokens,
        "kenspec.accepted_tokens": usage.accepted_tokens,
        "kenspec.rounds": usage.rounds,
    }
    streamed = [
        {
            "index": r.index,
            "tokens": len(r.token_ids),
            "drafted": r.drafted,
            "accepted": r.accepted,
            "mode": str(r.mode),
            "draft_source": r.draft_source,
        }
        for r in completion.rounds
    ]
    assert events(span, "round") == streamed


async def test_http_call_is_a_child_span_of_the_traceparent_header(start_server, exporter) -> None:
    server, _ = await start_server(otel=True, port=0)
    body = {
        "model": Path(server.settings.model.model).name,
        "prompt": "Hello there",
        "max_tokens": 12,
        "ignore_eos": True,
    }
    headers = {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        response = await client.post(url, json=body, headers=headers)
    assert response.status_code == 200, response.text
    answer = response.json()
    [span] = await finished_spans(server, exporter, 1)
    assert span.name == "POST /v1/completions"
    assert span.context.trace_id == int(PARENT_TRACE, 16)
    assert span.parent.span_id == int(PARENT_SPAN, 16)
    attributes = span.attributes
    assert attributes["kenspec.api"] == "http"
    assert attributes["kenspec.request_id"] == response.headers["x-request-id"]
    assert attributes["kenspec.status"] == "OK"
    assert attributes["kenspec.finish_reason"] == "length"
    assert attributes["kenspec.prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert attributes["kenspec.completion_tokens"] == 12
    statistics = answer["kenspec"]
    assert attributes["kenspec.rounds"] == statistics["rounds"]
    assert attributes["kenspec.drafted_tokens"] == statistics["drafted"]
    assert attributes["kenspec.accepted_tokens"] == statistics["accepted"]
    rounds = events(span, "round")
    assert [r["index"] for r in rounds] == list(range(statistics["rounds"]))
    assert sum(r["tokens"] for r in rounds) == 12


async def test_explicit_traceparent_from_the_bundled_client(start_server, exporter) -> None:
    server, _ = await start_server(otel=True)
    async with AsyncClient(f"127.0.0.1:{server.port}") as client:
        traceparent = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"
        stream = client.generate("Hi", max_new_tokens=3, traceparent=traceparent)
        rounds = await asyncio.wait_for(_read(stream), TIMEOUT)
        with pytest.raises(ValueError, match="traceparent"):
            client.generate("Hi", traceparent="00-nothex-01")
    assert rounds
    [span] = await finished_spans(server, exporter, 1)
    assert span.context.trace_id == int(PARENT_TRACE, 16)
    assert span.parent.span_id == int(PARENT_SPAN, 16)


async def test_refused_calls_end_their_span_with_an_error(start_server, exporter) -> None:
    server, stub = await start_server(otel=True, port=0)
    request = pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(max_new_tokens=100000))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(request, timeout=TIMEOUT).read()
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    body = {"model": Path(server.settings.model.model).name, "prompt": "Hi", "max_tokens": 100000}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        response = await client.post(url, json=body)
    assert response.status_code == 400
    spans = await finished_spans(server, exporter, 2)
    assert sorted(span.attributes["kenspec.api"] for span in spans) == ["grpc", "http"]
    for span in spans:
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "INVALID_ARGUMENT"
        assert span.attributes["kenspec.status"] == "INVALID_ARGUMENT"
        assert span.attributes["kenspec.rounds"] == 0
        assert events(span, "round") == []


async def test_tracing_off_records_nothing(start_server, exporter) -> None:
    server, _ = await start_server(otel=False)
    assert server.tracing is NO_TRACING
    async with AsyncClient(f"127.0.0.1:{server.port}") as client:
        caller = TracerProvider().get_tracer("test-caller")
        with caller.start_as_current_span("caller"):
            completion = await asyncio.wait_for(
                client.generate_text("Hi", max_new_tokens=3), TIMEOUT
            )
        with pytest.raises(InvalidRequest):
            await client.generate_text("Hi", max_new_tokens=100000)
    assert completion.usage.completion_tokens >= 1
    assert exporter.get_finished_spans() == ()


# A fresh interpreter: the server's modules with tracing off import none of its OpenTelemetry
# tracing (redis, which pybreaker imports when present, loads OpenTelemetry's metrics SDK
# itself when that is installed); then, OpenTelemetry missing, --otel fails at start-up
# saying what to install.
CHECK_IMPORTS = """
import sys
import kenspec.server.lifecycle, kenspec.server.__main__
from kenspec.server.request_spans import NO_TRACING
from kenspec.server.tracing import build_tracing
assert build_tracing(False, "", "model") is NO_TRACING
tracing = ("kenspec.server.otel", "opentelemetry.sdk.trace", "opentelemetry.exporter",
           "opentelemetry.propagate")
loaded = sorted(name for name in sys.modules if name.startswith(tracing))
assert not loaded, loaded
sys.modules["opentelemetry"] = None  # as if not installed
from kenspec.server.__main__ import main
sys.exit(main(["--otel", "--grpc-port", "0", "--port", "-1", "--metrics-port", "-1",
               "--log-format", "json"]))
"""


def test_no_opentelemetry_import_when_off_and_a_clear_error_without_it() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK_IMPORTS], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "startup_failed" in output
    assert "pip install 'kenspec[otel]'" in output
    assert "Traceback" not in output


def _round(index: int, breaker: BreakerState, **fields) -> Round:
    return Round(
        index=index,
        token_ids=(1, 2),
        text="ab",
        drafted=2,
        accepted=1,
        mode=Mode.SPECULATIVE,
        breaker_state=breaker,
        window_acceptance=0.5,
        source="kenlm",
        **fields,
    )


class RecordedEvents:
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def observe_pass(self, rows: int, tokens: int) -> None:
        self.seen.append(("pass", rows, tokens))

    def observe_reuse(self, tokens: int) -> None:
        self.seen.append(("reuse", tokens))

    def observe_transition(self, scope: str, state: BreakerState) -> None:
        self.seen.append(("transition", scope, state))

    def observe_round_work(self, seconds: float, drafted: bool) -> None:
        self.seen.append(("round_work", drafted))


@pytest.fixture
def memory_tracing() -> tuple[otel.OtelTracing, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return otel.OtelTracing(provider, "tiny"), memory


def test_breaker_transitions_are_events(memory_tracing) -> None:
    tracing, memory = memory_tracing
    engine_events = tracing.engine_events(inner := RecordedEvents())
    span = tracing.request_span("grpc", "Generate", "r-1", None)
    states = [BreakerState.CLOSED, BreakerState.OPEN, BreakerState.OPEN, BreakerState.HALF_OPEN]
    for index, state in enumerate(states):
        span.round(_round(index, state))
    engine_events.observe_transition("request", BreakerState.OPEN)  # seen in the rounds
    engine_events.observe_transition("draft", BreakerState.OPEN)
    engine_events.observe_pass(2, 7)
    span.round(_round(4, BreakerState.CLOSED, finish_reason=FinishReason.EOS))
    span.end(grpc.StatusCode.OK)
    engine_events.observe_transition("draft", BreakerState.CLOSED)  # after the call ended
    [ended] = memory.get_finished_spans()
    assert events(ended, "breaker") == [
        {"scope": "request", "state": "open", "round": 1},
        {"scope": "request", "state": "half_open", "round": 3},
        {"scope": "draft", "state": "open"},
        {"scope": "request", "state": "closed", "round": 4},
    ]
    assert ended.attributes["kenspec.finish_reason"] == "eos"
    assert inner.seen == [
        ("transition", "request", BreakerState.OPEN),
        ("transition", "draft", BreakerState.OPEN),
        ("pass", 2, 7),
        ("transition", "draft", BreakerState.CLOSED),
    ]


def test_round_events_are_capped(memory_tracing) -> None:
    tracing, memory = memory_tracing
    span = tracing.request_span("http", "POST /v1/completions", "r-2", None)
    total = otel.ROUND_EVENTS + 150
    for index in range(total):
        breaker = BreakerState.OPEN if index % 2 else BreakerState.CLOSED  # flapping
        span.round(_round(index, breaker))
    span.end(grpc.StatusCode.CANCELLED)
    span.end(grpc.StatusCode.OK)  # a second end changes nothing
    [ended] = memory.get_finished_spans()
    rounds = events(ended, "round")
    assert [r["index"] for r in rounds] == list(range(otel.ROUND_EVENTS))
    assert len(events(ended, "breaker")) == otel.BREAKER_EVENTS
    assert ended.attributes["kenspec.rounds"] == total
    assert ended.attributes["kenspec.round_events_dropped"] == 150
    assert ended.attributes["kenspec.completion_tokens"] == 2 * total
    assert ended.attributes["kenspec.status"] == "CANCELLED"
    assert ended.status.status_code is StatusCode.UNSET  # the client left: not a server error
    assert len(ended.events) == otel.ROUND_EVENTS + otel.BREAKER_EVENTS  # the SDK dropped none


def test_trace_context_from_grpc_metadata(memory_tracing) -> None:
    tracing, memory = memory_tracing
    metadata = (
        ("authorization", "Bearer x"),
        ("traceparent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"),
        ("blob-bin", b"\x00"),
    )
    tracing.request_span("grpc", "Generate", "r-3", metadata).end(grpc.StatusCode.INTERNAL)
    [ended] = memory.get_finished_spans()
    assert ended.context.trace_id == int(PARENT_TRACE, 16)
    assert ended.status.status_code is StatusCode.ERROR


async def _read(stream) -> list:
    return [item async for item in stream]


def test_a_port_in_use_fails_the_start_up_cleanly() -> None:
    """The metrics port is taken after gRPC and HTTP listen: the start-up fails with the
    reason, exit 1, and what had started stops before the loop closes (no traceback)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = ["--grpc-port", "0", "--port", "0", "--metrics-port", str(port)]
        result = subprocess.run(
            [sys.executable, "-m", "kenspec.server", *flags, "--log-format", "json"],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "startup_failed" in output and "address already in use" in output
    assert "Traceback" not in output and "never awaited" not in output

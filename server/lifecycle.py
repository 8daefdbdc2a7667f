"""The gRPC server's lifecycle: listen, load, serve, drain.

Health (grpc.health.v1) reports NOT_SERVING while the model loads and warms up, SERVING after,
and NOT_SERVING again once a drain starts. Reflection answers on both v1alpha (what
grpcio-reflection ships) and v1 (what current grpcurl asks first; the messages are identical,
so the v1 service is the same handler under the v1 name).

The drain (`stop`, on SIGTERM or SIGINT), in order:

1. Both ports keep listening. Health reports NOT_SERVING on both APIs (grpc.health.v1 Check
   and HTTP `/health`, 503), and every new call is refused at once, saying the server is
   draining: gRPC UNAVAILABLE, HTTP 503 with `Retry-After` and `Connection: close` (an unread
   body is drained by the lingering close, server.openai_api.connections).
2. The generate calls already admitted (streaming, queued for a slot, or an HTTP body still
   arriving) go on, until the last ends or the grace period (`--grace-period-s`) runs out,
   whichever comes first: the stop does not wait out the grace once they are done.
3. Calls still running then are cut (Serving.cut): gRPC ends them with UNAVAILABLE, HTTP
   with a 503 if nothing was sent yet, else a final `data: {"error": ...}` event and a
   complete chunked body; each message says the server shut down and the grace ran out.
4. The gRPC server stops (STOP_GRACE_S for short calls still open, then cancelled) and the
   HTTP server closes its listener and connections; then the engine thread, the pass costs,
   shared answers, metrics and traces are closed, and `stopped` is logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from kenspec.api import generator_pb2 as pb
from kenspec.server.answer_records import model_fingerprint
from kenspec.server.answer_stream import AnswerStream, StreamSettings
from kenspec.server.engine.events import EngineEvents
from kenspec.server.engine.gguf_model import GGUF_SUFFIX
from kenspec.server.extras import check_extras
from kenspec.server.grpc_front import FrontLimits, GrpcFront
from kenspec.server.memory import freeze_heap, thaw_heap
from kenspec.server.metrics import Metrics
from kenspec.server.metrics_http import metrics_access
from kenspec.server.openai_api.connections import ConnectionLimits
from kenspec.server.openai_api.http_server import HttpServer
from kenspec.server.openai_api.routes import GENERATE_PATHS, HttpLimits, build_app
from kenspec.server.runtime import Runtime, load_runtime
from kenspec.server.scheduler import Scheduler
from kenspec.server.security import BearerTokenInterceptor, read_tokens, tls_context
from kenspec.server.service import GeneratorService, generator_handler
from kenspec.server.serving import Serving, ShutDown
from kenspec.server.settings import LimitSettings, ModelSettings, Settings
from kenspec.server.tracing import build_tracing

log = structlog.get_logger("kenspec.server")

GENERATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
GENERATE_METHOD = f"/{GENERATOR_SERVICE}/Generate"
SHARED_ANSWERS_FLUSH_S = 2.0  # at stop, how long buffered answers get to reach Redis
CUT_REPORT_S = 2.0  # streams cut at the end of a drain: how long they get to say so
STOP_GRACE_S = 1.0  # after the drain, what is left (no generate call) gets this long
# grpc's own stream limit per connection, in times the limit the front tells clients (see
# grpc_options): grpc counts a finished call until grpc.aio has cleaned it up.
STREAM_HEADROOM = 2


def served_model_id(model: ModelSettings) -> str:
    """The model id the HTTP API lists and expects: --served-model-name, else the model's
    folder name, or a GGUF file's name without .gguf (`gemma-3-270m-q4_k_m`, as a folder of
    the converted model would be named)."""
    if model.served_model_name:
        return model.served_model_name
    path = Path(model.model)
    return path.stem if path.suffix == GGUF_SUFFIX else path.name


class KenspecServer:
    def __init__(
        self,
        settings: Settings,
        loader: Callable[[Settings, EngineEvents], Runtime] = load_runtime,
    ) -> None:
        check_extras(settings)  # a flag whose optional part is missing: ValueError
        self.settings = settings
        self._loader = loader
        server, limits, security = settings.server, settings.limits, settings.security
        self.scheduler = Scheduler(
            max_active=limits.max_concurrent_streams, max_queue=limits.max_queue
        )
        model_name = served_model_id(settings.model)
        self.metrics = Metrics(model_name)  # (its request-level metrics' model_name label)
        self.metrics_port: int | None = None
        self.tracing = build_tracing(server.otel, server.otel_service_name, model_name)
        tokens = read_tokens(security.auth_tokens_file) if security.auth_tokens_file else ()
        tokens += (security.api_key.encode(),) if security.api_key else ()
        self.serving = Serving(
            self.scheduler,
            self.metrics,
            limits.max_deadline_s,
            stall_timeout_s=limits.stream_stall_timeout_s,
            tracing=self.tracing,
            tokens=tokens,
            report_draft_source=settings.speculation.report_draft_source,
        )
        self.service = GeneratorService(self.serving)
        self.health = health_aio.HealthServicer()
        self.port = 0
        refused = self._count_grpc_refusal
        interceptors = [BearerTokenInterceptor(tokens, on_refused=refused)] if tokens else []
        self.http = self._http_server(tokens) if server.port >= 0 else None
        self.http_port: int | None = None
        self.answers: AnswerStream | None = None  # --share-answers, from load()
        self._server = grpc.aio.server(interceptors=interceptors, options=grpc_options(limits))
        # The public gRPC address is the front's (server.grpc_front): it bounds connections,
        # terminates TLS and relays to grpc, which listens on a private Unix socket only.
        self.front = GrpcFront(server.host, server.grpc_port, grpc_front_limits(limits))
        self._register()

    def _http_server(self, tokens: tuple[bytes, ...]) -> HttpServer:
        """The OpenAI-compatible API, on this loop and this Serving (server.openai_api)."""
        settings = self.settings
        server, limits, security = settings.server, settings.limits, settings.security
        app = build_app(
            self.serving,
            model_name=served_model_id(settings.model),
            tokens=tokens,
            limits=HttpLimits(limits.max_message_bytes, limits.http_body_timeout_s),
            allowed_hosts=security.allowed_hosts,
            bind_host=server.host,
            metrics=server.http_metrics,
        )
        return HttpServer(
            app,
            server.host,
            server.port,
            tls_cert=security.tls_cert,
            tls_key=security.tls_key,
            tls_client_ca=security.tls_client_ca,
            limits=http_connection_limits(limits),
            on_refused=self._count_http_refusal,
        )

    def _count_grpc_refusal(self, method: str) -> None:
        if method == GENERATE_METHOD:  # as the servicer counts: Generate calls only
            self.metrics.count_refusal("grpc", grpc.StatusCode.UNAUTHENTICATED.name)

    def _count_http_refusal(self, path: str) -> None:
        if path in GENERATE_PATHS:  # as the routes count: completions requests only
            self.metrics.count_refusal("http", grpc.StatusCode.RESOURCE_EXHAUSTED.name)

    def _register(self) -> None:
        self._server.add_generic_rpc_handlers([generator_handler(self.service)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        names = [GENERATOR_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        names += [reflection.SERVICE_NAME, REFLECTION_V1]
        reflector = reflection.aio.ReflectionServicer(names)
        reflection.enable_server_reflection(names, self._server)
        self._server.add_generic_rpc_handlers([_reflection_v1_handler(reflector)])

    async def start(self) -> int:
        """Listen (health NOT_SERVING until load() finishes); returns the bound port."""
        server, security = self.settings.server, self.settings.security
        tls = None
        if security.tls_cert or security.tls_key:
            if not (security.tls_cert and security.tls_key):
                raise ValueError("TLS needs both --tls-cert and --tls-key")
            tls = tls_context(
                security.tls_cert, security.tls_key, security.tls_client_ca, alpn="h2"
            )
        backend = self.front.backend_address()  # plaintext: only the front can reach it
        if self._server.add_insecure_port(backend) == 0:
            raise OSError(f"cannot listen on {backend}")
        self.port = await self.front.start(tls)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        log.info("listening", address=f"{server.host}:{self.port}")
        if self.http is not None:
            self.http_port = await self.http.start()
            scheme = "https" if security.tls_cert else "http"
            log.info("http_listening", address=f"{scheme}://{server.host}:{self.http_port}")
        if server.metrics_port >= 0:
            access = metrics_access(security, self.serving.tokens)
            host = server.metrics_host
            self.metrics_port = self.metrics.serve(host, server.metrics_port, access)
            address = f"{access.scheme}://{host}:{self.metrics_port}/metrics"
            log.info("metrics", address=address, token=bool(access.tokens))
        return self.port

    async def load(self) -> None:
        """Load and warm the model off the event loop, then report SERVING (and log `ready`:
        a request sent after that line is served, not refused as still loading)."""
        started = time.perf_counter()
        # What the imports made lives as long as the process: the load's collections skip it
        freeze_heap()
        # On the engine thread itself: a second thread running torch kernels leaves a second
        # OpenMP pool behind, which slows every later multi-token pass.
        events = self.tracing.engine_events(self.metrics)
        runtime = await self.scheduler.run(self._loader, self.settings, events)
        self.metrics.set_draft_breaker(runtime.engine.draft_breaker_state)
        self.serving.runtime = runtime
        if self.settings.speculation.share_answers:
            await self._share_answers(runtime)
        frozen = freeze_heap()  # the model, kept as long: serving's collections skip it too
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("ready", seconds=round(time.perf_counter() - started, 2), frozen_objects=frozen)

    async def _share_answers(self, runtime: Runtime) -> None:
        """Publish the answers the engine learns and learn the other replicas' (before
        SERVING: the catch-up starts before the first request, without waiting for it)."""
        engine = runtime.engine
        if engine.suffix is None:  # (a loader's runtime; parse_settings refuses this)
            log.warning("shared_answers_off", reason="the runtime has no suffix index")
            return
        fingerprint = await asyncio.to_thread(model_fingerprint, engine.target)
        speculation = self.settings.speculation
        settings = StreamSettings(
            url=speculation.share_answers,
            fingerprint=fingerprint,
            vocab_size=engine.target.vocab_size,
            maxlen=speculation.share_answers_maxlen,
            buffer=speculation.share_answers_buffer,
            isolate_tenants=engine.isolate_tenants,
        )
        self.answers = AnswerStream(settings, engine.suffix, self.metrics)
        engine.on_learned = self.answers.offer
        await self.answers.start()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain, then stop (the module doc says how): both ports keep answering, new calls
        refused and health NOT_SERVING, until the generate calls in flight end or the grace
        (--grace-period-s unless given) runs out; those left then are cut with an error."""
        grace = self.settings.server.grace_period_s if grace_s is None else grace_s
        self.serving.draining = True  # before the log line: no call slips in after it
        log.info("draining", grace_s=grace, calls=self.serving.calls_in_flight)
        await self.health.enter_graceful_shutdown()
        if not await self.serving.wait_idle(grace):
            cut = self.serving.cut(ShutDown(grace))
            log.warning("drain_cut", calls=cut, grace_s=grace)
            await self.serving.wait_idle(CUT_REPORT_S)  # each writes its error and ends
        # What is left is short (health checks, refusals, Tokenize, responses being flushed):
        # a brief grace, then grpc cancels its calls and the HTTP server closes connections.
        last = min(grace, STOP_GRACE_S)
        stopping = [self._server.stop(last)]
        if self.http is not None:
            stopping.append(self.http.stop(last))
        await asyncio.gather(*stopping)
        await self.front.close()  # after grpc: what it sent last reaches the clients
        await asyncio.to_thread(self.scheduler.shutdown)
        if self.serving.runtime is not None:  # the engine thread is done: its costs are still
            await asyncio.to_thread(self.serving.runtime.save_costs)
        if self.answers is not None:  # every answer is in: publish what is left, briefly
            if self.serving.runtime is not None:
                self.serving.runtime.engine.on_learned = None
            await self.answers.stop(SHARED_ANSWERS_FLUSH_S)
        self.metrics.close()
        await asyncio.to_thread(self.tracing.close)  # exports the spans left
        thaw_heap()  # (a process that goes on, e.g. tests: the runtime's garbage collected)
        log.info("stopped")

    async def wait(self) -> None:
        await self._server.wait_for_termination()

    async def _set_health(self, status: int) -> None:
        for name in ("", GENERATOR_SERVICE):
            await self.health.set(name, status)


def http_connection_limits(limits: LimitSettings) -> ConnectionLimits:
    return ConnectionLimits(
        max_connections=limits.http_max_connections,
        max_requests=limits.http_max_requests,
        header_timeout_s=limits.http_header_timeout_s,
        keepalive_timeout_s=limits.http_keepalive_timeout_s,
    )


def grpc_front_limits(limits: LimitSettings) -> FrontLimits:
    return FrontLimits(
        max_connections=limits.grpc_max_connections,
        handshake_timeout_s=limits.grpc_handshake_timeout_s,
        idle_timeout_s=limits.grpc_idle_timeout_s,
        max_streams=limits.grpc_max_streams_per_connection,
    )


def grpc_options(limits: LimitSettings) -> list[tuple[str, int]]:
    """Channel arguments of the gRPC server: message size and the bounds on connections.

    The connection cap is the front's (server.grpc_front), which evicts idle connections to
    make room; grpc core's own cap (`grpc.max_allowed_incoming_connections`) is left unset: it
    cannot evict, and would refuse a relayed connection while an evicted one it had not yet
    seen close still counted. The handshake and idle timeouts stay set here as well (the
    front's fire around the same time, as a backstop).

    Clients are told --grpc-max-streams-per-connection (the front caps the
    SETTINGS_MAX_CONCURRENT_STREAMS grpc sends), while grpc itself refuses a stream
    (RST_STREAM REFUSED_STREAM, which the client reports UNAVAILABLE) only past STREAM_HEADROOM
    times that: grpc counts a call until grpc.aio has cleaned it up, which lags the trailers, so
    with the same limit a client that opens a call as soon as the trailers of another arrive
    is refused. With the headroom, a call past the limit waits on the client's side (the
    scheduler answers RESOURCE_EXHAUSTED, with its retry pushback, past its queue), and grpc's
    limit still bounds what a client that ignores the advertised one can open or leave for
    grpc to clean up (grpc's protection against rapid resets)."""

    def ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    options = [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", limits.grpc_max_streams_per_connection * STREAM_HEADROOM),
        ("grpc.server_handshake_timeout_ms", ms(limits.grpc_handshake_timeout_s)),
        ("grpc.max_connection_idle_ms", ms(limits.grpc_idle_timeout_s)),
        # Keepalive enforcement: during calls, pings no closer than this; with no call open,
        # none at all (the idle limit closes such connections anyway); the third ping too
        # early gets GOAWAY too_many_pings. (grpc core's own server defaults are 5 min and 2
        # strikes; set here so they are stated, and the interval is a flag.)
        ("grpc.http2.min_ping_interval_without_data_ms", ms(limits.grpc_min_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 0),
    ]
    if limits.grpc_max_connection_age_s > 0:  # calls open at the GOAWAY may finish
        options.append(("grpc.max_connection_age_ms", ms(limits.grpc_max_connection_age_s)))
    return options


def _reflection_v1_handler(reflector: reflection.aio.ReflectionServicer) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        REFLECTION_V1,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                reflector.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )

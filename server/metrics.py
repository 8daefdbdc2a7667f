"""Prometheus metrics, on their own registry, served over HTTP(S) at /metrics (metrics_http).

Names follow Prometheus conventions: counters end in _total, durations are in _seconds.
Acceptance is accepted/drafted; per draft position it is
rate(kenspec_accepted_by_position_total[5m]) / rate(kenspec_drafted_by_position_total[5m]).
The request-level metrics carry a model_name label (the served model's id), and three of
them are named as vLLM's are: kenspec_e2e_request_latency_seconds,
kenspec_request_prompt_tokens and kenspec_time_per_output_token_seconds (with
kenspec_time_to_first_token_seconds), so dashboards made for vLLM read them with the prefix
changed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kenspec.api.outputs import BreakerState
from kenspec.server.engine.generation import Round
from kenspec.server.metrics_http import MetricsAccess, MetricsEndpoint

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5)
_PROMPT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1 to 500,000 tokens
_MAX_POSITION = 16  # per-position series beyond this are folded into the last one


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name  # the request-level metrics' model_name label
        r = self.registry
        self.requests = Counter(
            "kenspec_requests_total",
            "Generate calls (gRPC Generate, HTTP completions) by model, API, finish reason and "
            "status (gRPC status code names for both APIs).",
            ["model_name", "api", "finish_reason", "code"],
            registry=r,
        )
        self.stalled_streams = Counter(
            "kenspec_stalled_streams_total",
            "Streams cancelled because their client read nothing for --stream-stall-timeout-s.",
            registry=r,
        )
        self.active_streams = Gauge("kenspec_active_streams", "Streams generating now.", registry=r)
        self.queue_depth = Gauge(
            "kenspec_queue_depth", "Streams waiting for a generation slot.", registry=r
        )
        self.rounds = Counter(
            "kenspec_rounds_total", "Verification rounds by mode.", ["mode"], registry=r
        )
        self.drafted = Counter("kenspec_drafted_tokens_total", "Draft tokens proposed.", registry=r)
        self.accepted = Counter(
            "kenspec_accepted_tokens_total", "Draft tokens the target accepted.", registry=r
        )
        self.drafted_at = Counter(
            "kenspec_drafted_by_position_total",
            "Rounds that drafted a token at this position.",
            ["position"],
            registry=r,
        )
        self.accepted_at = Counter(
            "kenspec_accepted_by_position_total",
            "Rounds whose draft token here was accepted.",
            ["position"],
            registry=r,
        )
        self.generated = Counter(
            "kenspec_generated_tokens_total", "Tokens streamed to clients.", registry=r
        )
        self.breaker_transitions = Counter(
            "kenspec_breaker_transitions_total",
            "Circuit breaker transitions; scope is 'request' (acceptance) or 'draft' (faults).",
            ["scope", "state"],
            registry=r,
        )
        self.draft_breaker_state = Gauge(
            "kenspec_draft_breaker_state",
            "The process-wide draft-fault breaker: 1 for its current state.",
            ["state"],
            registry=r,
        )
        self._request_metrics(r)
        self.pass_rows = Histogram(
            "kenspec_batch_rows",
            "Streams verified together per forward pass (continuous batching).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.pass_tokens = Histogram(
            "kenspec_batch_pass_tokens",
            "Tokens in a verification pass, all streams' together (1 + drafts kept each, plus "
            "the prompt tokens of streams starting in it).",
            buckets=(1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512),
            registry=r,
        )
        self.round_overhead = Histogram(
            "kenspec_round_overhead_seconds",
            "An engine round's own work: its time outside the forward pass (drafting, choosing "
            "the drafts, laying out the pass, walking, learning, delivery); kind is 'draft' for "
            "rounds whose pass verified drafts, else 'plain'.",
            ["kind"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05),
            registry=r,
        )
        self.reused_prompt_tokens = Counter(
            "kenspec_prefix_cache_reused_tokens_total",
            "Prompt tokens whose keys/values were copied from the prefix cache, not computed.",
            registry=r,
        )
        self._shared_answers(r)
        self.set_draft_breaker(BreakerState.CLOSED)
        self._endpoint: MetricsEndpoint | None = None

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Per generate call, labelled with the served model (as vLLM's are)."""
        model = {"model_name": self.model_name}
        self.ttft = Histogram(
            "kenspec_time_to_first_token_seconds",
            "From request arrival to its first round.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**model)
        self.round_seconds = Histogram(
            "kenspec_round_seconds",
            "Time between consecutive rounds of a stream.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**model)
        self.tokens_per_second = Histogram(
            "kenspec_request_tokens_per_second",
            "Completion tokens per second, per finished request (from its arrival).",
            ["model_name"],
            buckets=(1, 2, 5, 10, 15, 20, 30, 50, 75, 100, 200, 500, 1000),
            registry=r,
        ).labels(**model)
        self.e2e_latency = Histogram(
            "kenspec_e2e_request_latency_seconds",
            "From a finished request's arrival to its last round (vLLM's e2e_request_latency).",
            ["model_name"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        ).labels(**model)
        self.prompt_tokens = Histogram(
            "kenspec_request_prompt_tokens",
            "Prompt tokens of a finished request (vLLM's request_prompt_tokens).",
            ["model_name"],
            buckets=_PROMPT_BUCKETS,
            registry=r,
        ).labels(**model)
        self.time_per_output_token = Histogram(
            "kenspec_time_per_output_token_seconds",
            "A finished request's time from its first round to its last, per token emitted "
            "after the first round (vLLM's request_time_per_output_token).",
            ["model_name"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        ).labels(**model)

    def _shared_answers(self, r: CollectorRegistry) -> None:
        """The shared answer stream's (--share-answers, server.answer_stream)."""
        self.shared_published = Counter(
            "kenspec_shared_answers_published_total",
            "Answers this replica published to the shared answer stream.",
            registry=r,
        )
        self.shared_received = Counter(
            "kenspec_shared_answers_received_total",
            "Answers of other replicas read from the shared stream and added to the index.",
            registry=r,
        )
        self.shared_dropped = Counter(
            "kenspec_shared_answers_dropped_total",
            "Answers not shared: buffer_full, redis_down and stopped (not published), "
            "foreign_model, malformed and tenant_scope (read, not added).",
            ["reason"],
            registry=r,
        )
        self.shared_connected = Gauge(
            "kenspec_shared_answers_connected",
            "1 while the link (publish, read) to the shared stream's Redis works, else 0.",
            ["link"],
            registry=r,
        )

    def count_refusal(self, api: str, code: str) -> None:
        """A generate call refused before its handler ran (a bearer token, a connection cap):
        counted as every other call is, with no finish reason."""
        self.count_request(api, "none", code)

    def count_request(self, api: str, finish_reason: str, code: str) -> None:
        self.requests.labels(
            model_name=self.model_name, api=api, finish_reason=finish_reason, code=code
        ).inc()

    def observe_round(self, round_: Round) -> None:
        self.rounds.labels(mode=round_.mode.value).inc()
        self.generated.inc(len(round_.token_ids))
        if round_.drafted:
            self.drafted.inc(round_.drafted)
            self.accepted.inc(round_.accepted)
            for position in range(min(round_.drafted, _MAX_POSITION)):
                label = str(position + 1)
                self.drafted_at.labels(position=label).inc()
                if position < round_.accepted:
                    self.accepted_at.labels(position=label).inc()

    def observe_pass(self, rows: int, tokens: int) -> None:
        self.pass_rows.observe(rows)
        self.pass_tokens.observe(tokens)

    def observe_reuse(self, tokens: int) -> None:
        self.reused_prompt_tokens.inc(tokens)

    def observe_round_work(self, seconds: float, drafted: bool) -> None:
        self.round_overhead.labels(kind="draft" if drafted else "plain").observe(seconds)

    def observe_transition(self, scope: str, state: BreakerState) -> None:
        self.breaker_transitions.labels(scope=scope, state=state.value).inc()
        if scope == "draft":
            self.set_draft_breaker(state)

    def set_draft_breaker(self, current: BreakerState) -> None:
        for state in BreakerState:
            self.draft_breaker_state.labels(state=state.value).set(int(state is current))

    def serve(self, host: str, port: int, access: MetricsAccess | None = None) -> int:
        """Serve /metrics on (host, port) as `access` asks (default: plaintext, open), from a
        thread of its own; port 0 picks a free one. Returns the bound port."""
        self._endpoint = MetricsEndpoint(self.registry, access or MetricsAccess())
        return self._endpoint.start(host, port)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None

"""Server settings: six groups, filled from CLI flags with KENSPEC_* environment fallbacks.

`Settings` is what the server reads, grouped as the engine uses it: `model` (what is served),
`kernels` (how the target computes), `speculation` (what drafts and when it stops), `server`
(listeners, logs, tracing), `limits` (what a caller may ask and hold) and `security` (TLS,
tokens, who may reach what). Each group checks its own fields when made; `check_rules` checks
the rules between flags, once a Settings is whole. Every flag `--some-name` falls back to the
environment variable `KENSPEC_SOME_NAME`, then to the default shown in `--help` (under its
group's heading); field names are unique across groups, so flags stay flat. Read once in
`__main__`, then passed down explicitly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kenspec.server.default_model import default_model_dir
from kenspec.server.engine.params import (
    MAX_DRAFT_TOKENS,
    AttentionMode,
    InvalidParameter,
    SpeculationParams,
    Weights,
)
from kenspec.server.tool_calls import FORMATS as TOOL_FORMATS

REPO_ROOT = Path(__file__).resolve().parent.parent  # a clone's root (benchmarks' prompts)
DEFAULT_MODEL = default_model_dir()  # fetched on first use when absent (kenspec serve)
# The default draft ships inside the package (a link to drafts/smollm2-135m in a clone).
DEFAULT_DRAFT = Path(__file__).resolve().parent / "default_draft"
MAX_TIMEOUT_S = 1_000_000  # connection timeouts, in seconds (gRPC takes them as int32 ms)
SHARE_ANSWERS_SCHEMES = ("redis", "rediss", "unix")


class SettingsError(ValueError):
    """A refused setting: `flag` names it (--tree-budget), `message` says why, naming it too.
    parse_settings reports it as a usage error; Settings made in code raise it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag
        self.message = message


class SuffixIndexScope(StrEnum):
    """Whose answers and cached prefixes a caller drafts from (--suffix-index-scope)."""

    TENANT = "tenant"
    SHARED = "shared"


class MetricsAuth(StrEnum):
    """What /metrics asks of a scraper (--metrics-auth); auto: what the APIs ask."""

    AUTO = "auto"
    NONE = "none"
    TOKEN = "token"
    TLS = "tls"
    TLS_TOKEN = "tls+token"

    @property
    def parts(self) -> frozenset[str]:
        """The checks it names: {"tls"}, {"token"}, both, or none (auto and none)."""
        return frozenset(self.value.split("+")) & {"tls", "token"}


class LogFormat(StrEnum):
    """console, json, or auto: console on a terminal, else JSON (--log-format)."""

    AUTO = "auto"
    CONSOLE = "console"
    JSON = "json"


class LogLevel(StrEnum):
    """The least severe log lines written (--log-level)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


_Mode = TypeVar("_Mode", bound=StrEnum)


def _flag(name: str) -> str:
    return (
        "--"
        + name.removesuffix("_s").removesuffix("_ms").replace("_", "-")
        + ("-s" if name.endswith("_s") else "-ms" if name.endswith("_ms") else "")
    )


def env_name(name: str) -> str:
    return "KENSPEC_" + _flag(name)[2:].replace("-", "_").upper()


def _mode(kind: type[_Mode], group: object, name: str, known: str = "") -> None:
    """Turn the field `name` of `group` into its enum `kind` (flags and the environment give
    strings), or refuse it naming the flag and the values it takes."""
    value = getattr(group, name)
    try:
        mode = kind(value)
    except ValueError:
        values = [member.value for member in kind]
        known = known or f"{', '.join(values[:-1])} or {values[-1]}"
        raise SettingsError(_flag(name), f"{_flag(name)} must be {known}, not {value!r}") from None
    object.__setattr__(group, name, mode)  # (frozen: once, while it is made)


def _at_least(group: object, names: Sequence[str], least: int) -> None:
    for name in names:
        value = getattr(group, name)
        if value < least:
            raise SettingsError(_flag(name), f"{_flag(name)} must be at least {least}, not {value}")


def _existing_file(name: str, path: str) -> None:
    if path and not Path(path).expanduser().is_file():
        raise SettingsError(_flag(name), f"{_flag(name)} {path}: no such file")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """What is served: the target, its draft, and the name the HTTP API gives it."""

    model: str = str(DEFAULT_MODEL)
    draft: str = str(DEFAULT_DRAFT)
    gguf_cache: str = "~/.cache/kenspec/gguf"
    chat_template: str = ""
    served_model_name: str = ""
    tool_call_format: str = "auto"

    def __post_init__(self) -> None:
        _existing_file("chat_template", self.chat_template)
        if self.tool_call_format not in TOOL_FORMATS:
            known = f"{', '.join(TOOL_FORMATS[:-1])} or {TOOL_FORMATS[-1]}"
            flag = _flag("tool_call_format")
            raise SettingsError(flag, f"{flag} must be {known}, not {self.tool_call_format!r}")

    @property
    def has_draft(self) -> bool:
        return self.draft.lower() not in ("", "none", "off")


@dataclass(frozen=True, slots=True)
class KernelSettings:
    """How the target computes: device, dtype, weights, and the kernels timed at start-up."""

    device: str = "auto"
    dtype: str = "auto"
    weights: Weights = Weights.AUTO
    threads: int = 0
    fast_step: bool = True
    amx: bool = True
    skinny_gemm: bool = True
    attention: AttentionMode = AttentionMode.AUTO
    batch_invariant: bool = False
    pad_verify: bool = True
    live_costs: bool = True
    calibration_cache: str = "~/.cache/kenspec/calibration"

    def __post_init__(self) -> None:
        _mode(Weights, self, "weights")
        _mode(AttentionMode, self, "attention")


@dataclass(frozen=True, slots=True)
class SpeculationSettings:
    """What drafts (KenLM, the request's context, the suffix index, recycled predictions), how
    much a round verifies, and the breakers that stop speculating."""

    # One default per knob: a request's SpeculationParams' (cap 16 nodes, chains of 6, fixed k).
    num_draft_tokens: int = SpeculationParams().num_draft_tokens
    chain_tokens: int = SpeculationParams().chain_tokens
    adaptive: bool = SpeculationParams().adaptive
    min_draft_prob: float = 0.4
    draft_context: bool = True
    context_min_match: int = 1
    context_max_match: int = 16
    long_draft_tokens: int = 16
    tree_budget: int = 16
    suffix_index: bool = True
    suffix_index_tokens: int = 1_000_000
    suffix_max_match: int = 32
    suffix_learn_prompts: bool = False
    suffix_corpus: str = ""
    suffix_index_scope: SuffixIndexScope = SuffixIndexScope.TENANT
    suffix_index_tenants: int = 16
    share_answers: str = ""  # redis://host:port/db; empty: this replica's answers are its own
    share_answers_maxlen: int = 100_000
    share_answers_buffer: int = 1024
    report_draft_source: bool = False
    recycled_predictions: bool = True
    draft_head: bool = False
    # circuit breakers
    breaker_window: int = 8
    breaker_threshold: float = -1.0  # < 0: calibrate from measured costs at start-up
    breaker_reset_timeout_s: float = 2.0
    draft_fault_max: int = 3
    draft_fault_reset_timeout_s: float = 30.0
    draft_latency_budget_ms: float = 50.0

    def __post_init__(self) -> None:
        try:  # the draft lengths are checked where a request's are: SpeculationParams
            SpeculationParams(
                num_draft_tokens=self.num_draft_tokens, chain_tokens=self.chain_tokens
            )
        except InvalidParameter as error:
            flag = _flag(error.field)
            raise SettingsError(flag, f"{flag} {error.message}") from None
        if not 1 <= self.tree_budget <= MAX_DRAFT_TOKENS:
            raise SettingsError(
                "--tree-budget",
                f"--tree-budget must be in [1, {MAX_DRAFT_TOKENS}], not {self.tree_budget}",
            )
        if not 0 <= self.long_draft_tokens <= MAX_DRAFT_TOKENS:
            raise SettingsError(
                "--long-draft-tokens",
                f"--long-draft-tokens must be in [0, {MAX_DRAFT_TOKENS}], "
                f"not {self.long_draft_tokens}",
            )
        if self.suffix_index_tokens < 0:
            raise SettingsError(
                "--suffix-index-tokens",
                f"--suffix-index-tokens must be 0 or more, not {self.suffix_index_tokens}",
            )
        _at_least(self, ("suffix_max_match",), 2)
        _mode(SuffixIndexScope, self, "suffix_index_scope")
        _at_least(self, ("suffix_index_tenants", "share_answers_maxlen", "share_answers_buffer"), 1)
        _check_share_answers_url(self.share_answers)
        _existing_file("suffix_corpus", self.suffix_corpus)

    @property
    def request_defaults(self) -> SpeculationParams:
        """What a request drafts when it asks nothing: these flags' draft lengths."""
        return SpeculationParams(
            num_draft_tokens=self.num_draft_tokens,
            chain_tokens=self.chain_tokens,
            adaptive=self.adaptive,
        )


def _check_share_answers_url(url: str) -> None:
    """--share-answers: a Redis URL the client can open (never a password in the message)."""
    if not url:
        return
    parsed = urlsplit(url)
    if parsed.scheme not in SHARE_ANSWERS_SCHEMES:
        shown = url.rpartition("@")[2]
        raise SettingsError(
            "--share-answers",
            "--share-answers must be a Redis URL starting redis://, rediss:// or unix:// "
            f"(redis://host:6379/0), not {shown!r}",
        )
    try:
        port = parsed.port
    except ValueError:
        port = -1
    database = parsed.path.strip("/") if parsed.scheme != "unix" else ""
    if (
        (parsed.scheme != "unix" and not parsed.hostname)
        or port == -1
        or not (database == "" or database.isdigit())
    ):
        raise SettingsError(
            "--share-answers",
            "--share-answers: a Redis URL needs a host, an optional numeric port and an "
            "optional database number (redis://host:6379/0)",
        )


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Where the server listens (gRPC, HTTP, /metrics), how it drains, logs and traces."""

    host: str = "127.0.0.1"
    port: int = 8000  # the OpenAI-compatible HTTP API (before 0.2: --http-port)
    grpc_port: int = 50051  # (before 0.2: --port)
    grace_period_s: float = 30.0
    metrics_port: int = 9400
    metrics_host: str = "127.0.0.1"
    http_metrics: bool = True
    log_format: LogFormat = LogFormat.AUTO
    log_level: LogLevel = LogLevel.INFO
    otel: bool = False
    otel_service_name: str = ""

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            if getattr(self, name) < -1:
                raise SettingsError(
                    _flag(name),
                    f"{_flag(name)} must be -1 (off), 0 (any free port) or a port number",
                )
        if self.port > 0 and self.port == self.grpc_port:
            raise SettingsError(
                "--port",
                f"--port (the HTTP API) and --grpc-port are both {self.port}: since 0.2 --port "
                "is the HTTP API's and gRPC's is --grpc-port",
            )
        _mode(LogFormat, self, "log_format")
        if isinstance(self.log_level, str):  # INFO as info, as the logging module names them
            object.__setattr__(self, "log_level", self.log_level.lower())
        _mode(LogLevel, self, "log_level")


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """What callers may ask and hold: deadlines, slots, batch rows, prompt and output lengths,
    messages, and both APIs' connections."""

    max_deadline_s: float = 600.0
    stream_stall_timeout_s: float = 30.0
    max_concurrent_streams: int = 8
    max_batch_size: int = 8
    prefill_chunk: int = 64
    prefill_chunk_alone: int = 512
    prefix_cache_mb: int = -1  # -1: sized from the model and the free memory at start-up
    max_queue: int = 32
    default_max_new_tokens: int = 0  # 0: the rest of the context, within the limit
    max_new_tokens_limit: int = 0  # 0: the model's context length
    max_prompt_tokens: int = 0  # 0: the model's context length
    max_prompt_chars: int = 0  # 0: max_prompt_tokens x the vocabulary's longest token
    tokenize_concurrency: int = 2
    max_stop_sequences: int = 64
    max_stop_length: int = 128
    max_message_bytes: int = 1 << 20
    http_max_connections: int = 256
    http_max_requests: int = 128
    http_header_timeout_s: float = 10.0
    http_keepalive_timeout_s: float = 5.0
    http_body_timeout_s: float = 10.0
    grpc_max_connections: int = 256
    grpc_max_streams_per_connection: int = 1000  # far above what the scheduler holds
    grpc_handshake_timeout_s: float = 10.0
    grpc_idle_timeout_s: float = 300.0
    grpc_max_connection_age_s: float = 0.0  # 0: no limit (streams may be long)
    grpc_min_ping_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.stream_stall_timeout_s > 0:
            raise SettingsError(
                "--stream-stall-timeout-s",
                f"--stream-stall-timeout-s must be above 0, not {self.stream_stall_timeout_s}",
            )
        if not self.http_body_timeout_s > 0:
            raise SettingsError(
                "--http-body-timeout-s",
                f"--http-body-timeout-s must be above 0, not {self.http_body_timeout_s}",
            )
        _at_least(
            self,
            (
                "http_max_connections",
                "http_max_requests",
                "grpc_max_connections",
                "grpc_max_streams_per_connection",
            ),
            1,
        )
        for name in (
            "http_header_timeout_s",
            "http_keepalive_timeout_s",
            "grpc_handshake_timeout_s",
            "grpc_idle_timeout_s",
            "grpc_min_ping_interval_s",
        ):
            if not 0 < getattr(self, name) <= MAX_TIMEOUT_S:  # (NaN too)
                raise SettingsError(
                    _flag(name),
                    f"{_flag(name)} must be above 0 and at most {MAX_TIMEOUT_S}, "
                    f"not {getattr(self, name)}",
                )
        if not 0 <= self.grpc_max_connection_age_s <= MAX_TIMEOUT_S:
            raise SettingsError(
                "--grpc-max-connection-age-s",
                f"--grpc-max-connection-age-s must be 0 (no limit) to {MAX_TIMEOUT_S}, "
                f"not {self.grpc_max_connection_age_s}",
            )
        if self.prefix_cache_mb < -1:
            raise SettingsError(
                "--prefix-cache-mb",
                f"--prefix-cache-mb must be -1 (auto), 0 (off) or more, not {self.prefix_cache_mb}",
            )
        if self.max_prompt_chars < 0:
            raise SettingsError(
                "--max-prompt-chars",
                f"--max-prompt-chars must be 0 (derived) or more, not {self.max_prompt_chars}",
            )
        _at_least(self, ("default_max_new_tokens", "max_new_tokens_limit"), 0)
        _at_least(self, ("max_stop_sequences", "max_stop_length"), 0)
        _at_least(
            self,
            (
                "tokenize_concurrency",
                "max_batch_size",
                "prefill_chunk",
                "prefill_chunk_alone",
                "max_concurrent_streams",
            ),
            1,
        )


_HOST_NAME = re.compile(r"\*|[A-Za-z0-9_.-]+|\[?[0-9A-Fa-f:.]+\]?")


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    """TLS, bearer tokens, what /metrics asks, and the Host names the HTTP API answers."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_tokens_file: str = ""
    api_key: str = field(default="", repr=False)  # a secret: kept out of logs and reprs
    metrics_auth: MetricsAuth = MetricsAuth.AUTO
    allowed_hosts: str = ""

    @property
    def authenticates(self) -> bool:
        """Calls need a bearer token: --api-key, --auth-tokens-file or both."""
        return bool(self.api_key or self.auth_tokens_file)

    def __post_init__(self) -> None:
        if self.api_key != self.api_key.strip() or any(c.isspace() for c in self.api_key):
            raise SettingsError("--api-key", "--api-key must not contain whitespace")
        known = f"one of {', '.join(MetricsAuth)}"
        _mode(MetricsAuth, self, "metrics_auth", known)
        for name in self.allowed_hosts.split(","):
            if name.strip() and not _HOST_NAME.fullmatch(name.strip()):
                raise SettingsError(
                    "--allowed-hosts",
                    f"--allowed-hosts: {name.strip()!r} is not a host name or address "
                    "(comma-separated names, no ports, '*' for any)",
                )


# The groups, as --help shows them: Settings' field, its heading's description.
GROUPS: dict[str, tuple[type, str]] = {
    "model": (ModelSettings, "what is served: the target model, its draft, its name"),
    "kernels": (KernelSettings, "how the target computes: device, dtype, weights, kernels"),
    "speculation": (SpeculationSettings, "what drafts, how much a round verifies, the breakers"),
    "server": (ServerSettings, "listeners, shutdown, logs and tracing"),
    "limits": (LimitSettings, "what callers may ask and hold; both APIs' connections"),
    "security": (SecuritySettings, "TLS, bearer tokens, /metrics access, allowed Host names"),
}

# Every field's group: its flag (--name) and variable (KENSPEC_NAME) are flat, names unique.
FIELD_GROUPS: dict[str, str] = {
    item.name: group for group, (kind, _) in GROUPS.items() for item in fields(kind)
}


@dataclass(frozen=True, slots=True)
class Settings:
    """The server's settings, in the groups the engine uses them by; made whole, it checks the
    rules between flags (check_rules). `Settings.of(**flat)` and `settings.replace(**flat)`
    take flat field names (grpc_port=0, dtype="bfloat16"), routed to their groups."""

    model: ModelSettings = field(default_factory=ModelSettings)
    kernels: KernelSettings = field(default_factory=KernelSettings)
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)

    def __post_init__(self) -> None:
        check_rules(self)

    @classmethod
    def of(cls, **flat: Any) -> Settings:
        """Settings from flat field names, each group's others at their defaults."""
        return cls().replace(**flat)

    def replace(self, **flat: Any) -> Settings:
        """These settings with flat fields changed (each group checks its own again)."""
        unknown = sorted(set(flat) - set(FIELD_GROUPS))
        if unknown:
            raise TypeError(f"Settings has no field {', '.join(unknown)}")
        groups = {
            group: dataclasses.replace(
                getattr(self, group),
                **{name: value for name, value in flat.items() if FIELD_GROUPS[name] == group},
            )
            for group in {FIELD_GROUPS[name] for name in flat}
        }
        return dataclasses.replace(self, **groups)


def check_rules(settings: Settings) -> None:
    """The rules between flags, in one place (each group checked its own fields)."""
    kernels, speculation, security = settings.kernels, settings.speculation, settings.security
    if kernels.weights in (Weights.INT8, Weights.INT4):  # computed by the lean forward only
        flag = f"--weights {kernels.weights}"
        if not kernels.fast_step:
            raise SettingsError(
                "--weights",
                f"{flag} runs through the fast step: it cannot be combined with --no-fast-step",
            )
        if kernels.batch_invariant:
            raise SettingsError(
                "--weights",
                f"{flag} cannot be combined with --batch-invariant (which pads the model's "
                f"own layers; {kernels.weights} runs through the fast step)",
            )
        if kernels.dtype == "float16":
            raise SettingsError(
                "--weights", f"{flag} computes in bfloat16 or float32: not with --dtype float16"
            )
    if kernels.weights == Weights.GGUF:  # the file's own groups: refused where they cannot be
        if kernels.batch_invariant:
            raise SettingsError(
                "--weights",
                "--weights gguf cannot be combined with --batch-invariant (which pads the "
                "model's own layers); --weights auto serves the file dequantized there",
            )
        if kernels.dtype == "float16":
            raise SettingsError(
                "--weights", "--weights gguf computes in bfloat16 or float32: not --dtype float16"
            )
    indexed = speculation.suffix_index and speculation.draft_context
    if speculation.share_answers and not indexed:
        raise SettingsError(
            "--share-answers",
            "--share-answers shares the suffix index: it needs --suffix-index and --draft-context",
        )
    if speculation.suffix_corpus:
        if not indexed:
            raise SettingsError(
                "--suffix-corpus",
                "--suffix-corpus seeds the suffix index: it needs --suffix-index and "
                "--draft-context",
            )
        if speculation.suffix_index_tokens == 0:
            raise SettingsError(
                "--suffix-corpus",
                "--suffix-corpus needs room in the suffix index: --suffix-index-tokens is 0",
            )
    auth = security.metrics_auth
    if "token" in auth.parts and not security.authenticates:
        raise SettingsError(
            "--metrics-auth",
            f"--metrics-auth {auth} needs --api-key or --auth-tokens-file (the tokens it accepts)",
        )
    if "tls" in auth.parts and not (security.tls_cert and security.tls_key):
        raise SettingsError(
            "--metrics-auth",
            f"--metrics-auth {auth} needs --tls-cert and --tls-key (what it serves)",
        )


_HELP = {
    "model": "target model: a local Hugging Face causal-LM folder, or a GGUF file (or a folder "
    "holding one), dequantized to --dtype (default: the bundled SmolLM2)",
    "gguf_cache": "folder that keeps a GGUF --model dequantized, as a Hugging Face folder per "
    "file checksum, dtype and kenspec/transformers versions, so a restart loads it at once",
    "chat_template": "a Jinja chat template file that the model's tokenizer uses instead of "
    "its own, or gives a model without one (many GGUF files of base models carry none); "
    "empty: the model's",
    "tool_call_format": "how the model writes tool calls: auto (read off its chat template: "
    "hermes <tool_call> blocks, llama3_json, mistral [TOOL_CALLS]; a template that renders no "
    "tools gets kenspec's own prompt, as prompt), hermes, llama3_json, mistral or prompt",
    "draft": "draft: a KenLM draft folder or ARPA file; 'none' decodes autoregressively only",
    "device": "auto (CUDA when available, else CPU), cpu, cuda, cuda:N",
    "dtype": "auto (bfloat16 on CUDA and bf16-capable CPUs, else float32), float32, bfloat16, "
    "float16",
    "weights": "how the linear layers' weights are kept: auto (a GGUF file's own quantization, "
    "or that of the file a folder keeps as the default model does, where it can be served so: "
    "a CPU with the grouped GEMV, --dtype bfloat16, not --batch-invariant; else as loaded), "
    "gguf (the file's own, or refuse: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, ... "
    "kept as the file holds them, F16/BF16/F32 as loaded), bf16 (as loaded, in "
    "--dtype; a GGUF file dequantized), int8 "
    "(weight-only, symmetric, one scale per output row; the output layer too, the embedding "
    "stays in --dtype) or int4 (the decoder's layers in groups of 32 weights with a scale and "
    "an offset each, as GGUF's Q4_1, through torch's int4 kernel; the output layer int8): a "
    "CPU, the fast step's models (Llama, Mistral, Qwen2), --dtype bfloat16 or float32 (the "
    "activations); needs --fast-step, not --batch-invariant",
    "threads": "torch CPU threads (0: torch's default, one per core)",
    "host": "address to listen on (0.0.0.0 for every interface, as in containers)",
    "grpc_port": "gRPC port (0: pick a free one and log it; before 0.2 this was --port)",
    "grace_period_s": "on SIGTERM, seconds in-flight streams get to finish before being cancelled",
    "tls_cert": "PEM certificate chain: serve TLS (with --tls-key) instead of plaintext",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA: require client certificates signed by it (mutual TLS)",
    "auth_tokens_file": "file of allowed bearer tokens, one a line: every call but health "
    "needs 'authorization: Bearer <token>' (empty: no authentication unless --api-key)",
    "api_key": "one allowed bearer token (OpenAI clients send it as their api_key), beside "
    "--auth-tokens-file's; prefer the variable to the flag, which other users can read in the "
    "process list (empty: none)",
    "max_deadline_s": "longest a Generate call may run, whatever deadline the client set",
    "stream_stall_timeout_s": "cancel a stream whose client reads nothing for this long (its "
    "window full, a message waits): it no longer holds a slot or its unsent rounds",
    "metrics_port": "Prometheus /metrics HTTP port on --metrics-host (0: pick a free one; -1: off)",
    "metrics_host": "address /metrics listens on, apart from --host: loopback unless set (a "
    "scraper on another host or container needs e.g. 0.0.0.0)",
    "metrics_auth": "what /metrics asks of a scraper: auto (as the APIs: HTTPS with --tls-cert, "
    "a client certificate with --tls-client-ca, a bearer token of --auth-tokens-file with it), "
    "none (plaintext, open to whoever reaches it), token, tls, or tls+token",
    "port": "OpenAI-compatible HTTP API port on --host (/v1/chat/completions, "
    "/v1/completions, /v1/models, /health), beside gRPC on the same engine, with the same "
    "tokens, TLS and limits (0: pick a free one; -1: off; before 0.2 this was --http-port)",
    "http_metrics": "also serve /metrics on --port, asking what the HTTP API asks (a "
    "bearer token of --auth-tokens-file, its TLS; without tokens, its Host check), whatever "
    "--metrics-auth says; --no-http-metrics leaves them to --metrics-port alone",
    "served_model_name": "the model id the HTTP API lists and expects in requests' model field "
    "(empty: the model folder's name, or a GGUF file's name without .gguf)",
    "allowed_hosts": "without --auth-tokens-file, the HTTP API answers only requests whose Host "
    "(and Origin, when sent) is a loopback name or address, --host when it is one address, or "
    "one of these comma-separated names ('*': any); others get 421 (Host) or 403 (Origin), "
    "which keeps web pages in a local browser out (DNS rebinding, cross-site posts). With "
    "tokens the token is the check and no name is. /health is never checked",
    "http_body_timeout_s": "seconds an HTTP request has to send its whole body; past it, 408 "
    "and the connection is closed",
    "num_draft_tokens": "the most draft tokens (nodes) a round verifies per request (1-64), "
    "whatever drafted them: token trees, long matches and chains all stay within it; requests "
    "may ask for fewer",
    "chain_tokens": "draft tokens of an ordinary chain (k: KenLM's, a short match's), within "
    "--num-draft-tokens",
    "adaptive": "grow k after fully accepted rounds and shrink it after rejections (within "
    "--chain-tokens)",
    "min_draft_prob": "stop a KenLM chain at the first n-gram step below this probability (in "
    "a token tree, 0.05: the tree's learned path probability decides)",
    "pad_verify": "measure pass costs at start-up and pad verify passes to a wider width "
    "when that is cheaper (small-GEMM kernels are not monotonic on some CPUs)",
    "skinny_gemm": "on CPU in float32, time at start-up at which small row counts (2-5 tokens "
    "in a pass) the linear layers run faster as W @ x^T than as x @ W^T, and use it there",
    "fast_step": "on CPU in bfloat16 (or a GGUF file's own weights), run Llama, Mistral, "
    "Qwen2, Qwen3, Phi-3 and Gemma 2/3 models through kenspec's "
    "lean decoder loop (fused products, each product's kernel timed at start-up by row "
    "count: kenspec's bf16 GEMV (AVX512-BF16, or AVX2), oneDNN with packed weights, or "
    "torch's); --no-fast-step keeps transformers' forward",
    "amx": "on CPUs with AMX-BF16 (Xeon Sapphire Rapids and later), compute the fast step's "
    "bf16 decoder products through AMX tiles at every width (a verify pass of up to 16 "
    "tokens then costs about one step); --no-amx keeps the AVX512-BF16 GEMV",
    "attention": "attention of passes with a few queries per row: auto (grouped products over "
    "the cache where timed faster than SDPA at start-up, by queries per row and context "
    "length), sdpa (torch's scaled_dot_product_attention always) or grouped (always, up to "
    "16 queries per row)",
    "batch_invariant": "batch-invariant kernels: every token's logits bit-identical whatever "
    "shares its pass, so greedy output is identical with speculation on or off, alone or in a "
    "batch, with or without the prefix cache, in bf16 as in float32 (linear layers and passes "
    "padded to row counts measured at start-up, an attention kernel over padded keys for "
    "every pass, the output layer over the pass, token trees kept within the measured block "
    "of summed keys, or chains where none is measured; overrides --skinny-gemm and "
    "--attention)",
    "draft_context": "also draft from the request's own prompt and output (longest earlier "
    "match of the last tokens), the n-gram continuing; requests can switch it",
    "context_min_match": "shortest suffix match (tokens) that makes the context draft propose",
    "context_max_match": "longest suffix match (tokens) the context draft looks for",
    "tree_budget": "with context drafting, verify a token tree of up to this many draft nodes "
    "(within --num-draft-tokens) merging every source's candidates (KenLM n-best, context and "
    "suffix-index matches, recycled predictions), best path probability first; the batch "
    "keeps the nodes worth their cost; 1: one chain per round",
    "long_draft_tokens": "how far a chain after a long exact match (context or suffix index) "
    "may draft: as many tokens as the match is long, up to this (at least k; within "
    "--num-draft-tokens)",
    "suffix_index": "with context drafting, also draft from an index of past answers "
    "(seeded from the draft folder's corpus.ids.gz, learning every finished response, per "
    "tenant: see --suffix-index-scope): the longest exact match of the stream's last tokens, "
    "most frequent continuation",
    "suffix_index_tokens": "most token ids the suffix index holds, the seeded corpus included "
    "(never evicted); learned answers share the rest, each tenant's oldest out (about 150 MB "
    "per million); 0: keep no answers",
    "suffix_max_match": "longest match (tokens) the suffix index looks for",
    "suffix_learn_prompts": "the suffix index also learns each finished request's prompt",
    "suffix_corpus": "a plain-text file (UTF-8) the suffix index is seeded from at start-up, "
    "each passage (lines up to a blank line) tokenized with the target's tokenizer, shared by "
    "every tenant like the draft's corpus: drafts for a new model before any draft is trained "
    "(--draft none); empty: none",
    "suffix_index_scope": "tenant: each bearer token (every caller, without --auth-tokens-file) "
    "drafts from the seeded corpus and its own past answers only, and reuses its own cached "
    "prefixes only; shared: every caller drafts from every caller's answers and prefixes, "
    "which reveals to any caller, through the drafted and accepted counts and the time to "
    "first token, whether other callers' answers or prompts contained a phrase it guesses",
    "suffix_index_tenants": "tenants whose learned state is kept: answers in the suffix index, "
    "each within an equal share of --suffix-index-tokens, recycled predictions and acceptance "
    "statistics; beyond, the least recently used tenant's is dropped",
    "share_answers": "a Redis URL (redis://host:port/db, rediss:// for TLS): publish every "
    "answer the suffix index learns to a Redis Stream and learn the answers other replicas of "
    "the same model and tokenizer publish there, each into its own tenant's index; Redis down "
    "or slow never delays a request (answers are then lost, and counted). Empty: off",
    "share_answers_maxlen": "about how many answers the shared stream keeps (XADD MAXLEN ~): "
    "what a replica started later catches up from",
    "share_answers_buffer": "answers waiting to be published; beyond, new ones are dropped "
    "(and counted)",
    "report_draft_source": "stream each round's draft source (kenlm, context:N, suffix:N, ...) "
    "to the caller; off: the field is empty (gRPC) or absent (HTTP)",
    "recycled_predictions": "with context drafting, also draft from the target's own recent "
    "predictions: the top next tokens every pass computed after each token, kept per token",
    "draft_head": "with context drafting, also draft from the learned head in the draft "
    "folder (head.json, built by `python -m draft_tools head`) where it has one for this "
    "target: a small network over the target's own last hidden state (off by default: on "
    "the default model it adds ~0.2 tokens a round and costs about as much time)",
    "live_costs": "update the measured pass costs (and the calibrated breaker threshold) from "
    "the timing of every verify pass, measuring widths the draft choice avoids now and then; "
    "off: start-up's numbers for the process's life",
    "calibration_cache": "folder that keeps start-up pass costs per model, dtype, device and "
    "CPU (the live ones at shutdown), so a restart does not measure again; 'none': always "
    "measure",
    "breaker_window": "speculative rounds in a request's breaker window",
    "breaker_threshold": "negative (default): a request falls back to plain decoding once its "
    "drafting rounds took longer, as measured, than plain decoding would have for the tokens "
    "they gave; >= 0: once the acceptance they imply falls below this. While open it still "
    "verifies copies (the continuation of an exact match of 4 or more tokens)",
    "breaker_reset_timeout_s": "seconds before an open request breaker tries speculation again",
    "draft_fault_max": "consecutive draft faults that switch the draft off for every request",
    "draft_fault_reset_timeout_s": "seconds before a faulty draft is tried again",
    "draft_latency_budget_ms": "a draft proposal slower than this counts as a fault",
    "max_concurrent_streams": "streams generating at once; more wait in the queue",
    "max_batch_size": "streams verified together in one forward pass (continuous batching); "
    "admitted streams beyond it wait for a row",
    "prefill_chunk": "prompt tokens per pass beside running streams: new prompts within it join "
    "the running streams' next pass; a longer prompt is prefilled in chunks of this size, so it "
    "delays them by one chunk at a time, not all at once",
    "prefill_chunk_alone": "prompt tokens per pass while no stream is running, or when the new "
    "prompts are at least as many as the running streams: a lone request or a burst that fits "
    "starts in one pass; a lone longer prompt is chunked in this size",
    "prefix_cache_mb": "memory for the keys/values of recent prompts, reused by later prompts "
    "that begin the same way (a shared system prompt, a document, earlier turns of a "
    "conversation); -1: room for four full contexts of the model, at most a tenth of the "
    "memory available at start-up; 0 disables",
    "max_queue": "streams waiting for a slot; beyond that RESOURCE_EXHAUSTED",
    "default_max_new_tokens": "new tokens of a request that sets no limit (gRPC max_new_tokens 0, "
    "HTTP max_tokens absent), cut to what the context leaves after its prompt (finish reason "
    "length there); 0: the rest of the context, within --max-new-tokens-limit",
    "max_new_tokens_limit": "largest max_new_tokens (HTTP max_tokens) a request may ask for; "
    "one asked for must also fit the context with the prompt, else the request is refused "
    "naming both numbers (0: the model's context length)",
    "max_prompt_tokens": "longest prompt in tokens (0: the model's context length)",
    "max_prompt_chars": "longest prompt (or chat, or Tokenize input) in characters, refused "
    "before any tokenizer work (0: the token limit x the most characters one token of the "
    "vocabulary spans, which no text that fits the token limit exceeds)",
    "tokenize_concurrency": "inputs of over 16,384 characters tokenized at once (each keeps a "
    "CPU core busy); more wait their turn, shorter ones never wait",
    "max_stop_sequences": "most stop sequences per request (each is searched for in the text "
    "every generated token adds)",
    "max_stop_length": "longest stop sequence in characters",
    "max_message_bytes": "largest request message in bytes",
    "http_max_connections": "open HTTP connections; a connection beyond it closes the one "
    "idle longest (no request in flight), or, with none idle, gets 503 and is closed",
    "http_max_requests": "HTTP requests in flight (reading their body, waiting, generating, "
    "streaming); beyond it 429 with Retry-After, before the body is read",
    "http_header_timeout_s": "an HTTP connection that has not sent a request's complete headers "
    "this long after opening (TLS handshake included) or after its previous response is "
    "closed (408 when it had sent part of them)",
    "http_keepalive_timeout_s": "an HTTP keep-alive connection that sends nothing this long after "
    "a response is closed",
    "grpc_max_connections": "open gRPC connections (TLS handshakes under way included); a "
    "connection beyond it closes the one idle longest (no call open), after a GOAWAY, or, with "
    "none idle, is closed at once",
    "grpc_max_streams_per_connection": "concurrent calls per gRPC connection that clients are "
    "told (HTTP/2 MAX_CONCURRENT_STREAMS; grpc itself refuses only past twice it): calls past "
    "it wait on the client's side; past --max-concurrent-streams + --max-queue the scheduler "
    "answers RESOURCE_EXHAUSTED with a retry delay",
    "grpc_handshake_timeout_s": "a gRPC connection that has not finished its TLS handshake and "
    "sent the HTTP/2 preface and its first settings this long after opening is closed",
    "grpc_idle_timeout_s": "a gRPC connection with no call for this long gets GOAWAY (clients "
    "reconnect on their next call), and is closed a second later if still open",
    "grpc_max_connection_age_s": "a gRPC connection is asked to go away (GOAWAY) after this long, "
    "its calls left to finish, so clients rebalance across replicas (0: never)",
    "grpc_min_ping_interval_s": "shortest interval between a client's keepalive pings during "
    "calls (pings with no call open are refused); a client pinging faster gets GOAWAY "
    "too_many_pings, so clients' keepalive time must be at least this",
    "log_format": "console, json, or auto (console on a terminal, else JSON)",
    "log_level": "debug, info, warning or error",
    "otel": "OpenTelemetry tracing: a span per generate call, exported as the standard OTEL_* "
    "variables say (OTLP to OTEL_EXPORTER_OTLP_ENDPOINT); needs pip install 'kenspec[otel]'",
    "otel_service_name": "service.name of the spans (empty: OTEL_SERVICE_NAME, else kenspec)",
}


def parse_settings(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> Settings:
    """Flags override KENSPEC_* variables, which override the defaults; a refused value is a
    usage error naming its flag (exit 2)."""
    environ = os.environ if env is None else env
    parser = build_parser(environ)
    namespace = parser.parse_args(argv)
    try:
        return Settings.of(**vars(namespace))
    except SettingsError as error:
        parser.error(error.message)


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kenspec serve",
        description="kenspec: speculative decoding over gRPC (KenLM draft, transformers target). "
        "Every flag can also be set with the KENSPEC_* variable shown.",
    )
    for group, (kind, description) in GROUPS.items():
        section = parser.add_argument_group(group, description)
        defaults = kind()
        for item in fields(kind):
            default = getattr(defaults, item.name)
            raw = _environ_value(environ, item.name)
            value = default if raw is None else _convert(raw, default, parser, item.name)
            help_text = f"{_HELP[item.name]} [env {env_name(item.name)}; default: %(default)s]"
            if isinstance(default, bool):
                section.add_argument(
                    _flag(item.name),
                    dest=item.name,
                    default=value,
                    action=argparse.BooleanOptionalAction,
                    help=help_text,
                )
            else:
                section.add_argument(
                    _flag(item.name),
                    dest=item.name,
                    default=value,
                    type=str if isinstance(default, StrEnum) else type(default),
                    metavar=item.name.upper(),
                    help=help_text,
                )
    for old, name in RENAMED.items():
        parser.add_argument(
            old, dest=name, type=int, action=_Renamed, new=_flag(name), help=argparse.SUPPRESS
        )
    return parser


# Flags renamed in 0.2, still taken for one release: the HTTP API moved to --port (gRPC to
# --grpc-port), as servers of the OpenAI API name their port.
RENAMED = {"--http-port": "port"}
RENAMED_ENV = {"KENSPEC_HTTP_PORT": "port"}


class _Renamed(argparse.Action):
    """An old flag: sets the new one's field and says so on stderr."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        print(f"warning: {option} is now {self.new}; the old name goes in 0.3", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _environ_value(environ: Mapping[str, str], name: str) -> str | None:
    """KENSPEC_<NAME>, else the variable it was called before 0.2 (with a warning)."""
    raw = environ.get(env_name(name))
    if raw is not None:
        return raw
    for old, renamed in RENAMED_ENV.items():
        if renamed == name and old in environ:
            print(
                f"warning: {old} is now {env_name(name)}; the old name goes in 0.3", file=sys.stderr
            )
            return environ[old]
    return None


def _convert(raw: str, default: object, parser: argparse.ArgumentParser, name: str) -> object:
    """A KENSPEC_* variable's value as its field's type; a mode stays a string, checked with
    the flag's (the group's message names the values it takes)."""
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes", "on")
        if isinstance(default, StrEnum):
            return raw
        kind: Any = type(default)  # int, float or str
        return kind(raw)
    except ValueError:
        parser.error(f"{env_name(name)}={raw!r} is not a valid {type(default).__name__}")

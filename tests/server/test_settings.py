"""Command-line settings: defaults, flags over environment, and refused values."""

from __future__ import annotations

import pytest

from kenspec.server.engine.params import AttentionMode, SpeculationParams, Weights
from kenspec.server.settings import (
    FIELD_GROUPS,
    GROUPS,
    LogLevel,
    MetricsAuth,
    Settings,
    SettingsError,
    SuffixIndexScope,
    env_name,
    parse_settings,
)


def test_flags_override_the_environment_which_overrides_defaults() -> None:
    env = {"KENSPEC_PREFILL_CHUNK_ALONE": "256", "KENSPEC_PREFILL_CHUNK": "32"}
    settings = parse_settings(["--prefill-chunk", "16"], env=env)
    assert settings.limits.prefill_chunk == 16
    assert settings.limits.prefill_chunk_alone == 256
    default = parse_settings([], env={}).limits
    assert default.prefill_chunk_alone == Settings().limits.prefill_chunk_alone


@pytest.mark.parametrize(
    "flag",
    ["--max-batch-size", "--prefill-chunk", "--prefill-chunk-alone", "--max-concurrent-streams"],
)
def test_counts_below_one_are_refused_with_the_flag_named(flag, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_settings([flag, "0"], env={})
    assert exit_.value.code == 2
    assert f"{flag} must be at least 1, not 0" in capsys.readouterr().err


def test_a_negative_prefix_cache_is_refused_and_zero_turns_it_off(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--prefix-cache-mb", "-2"], env={})
    assert "--prefix-cache-mb must be -1 (auto), 0 (off) or more, not -2" in capsys.readouterr().err
    assert parse_settings(["--prefix-cache-mb", "0"], env={}).limits.prefix_cache_mb == 0
    assert parse_settings([], env={}).limits.prefix_cache_mb == -1  # sized at start-up


@pytest.mark.parametrize("value", ["0", "65"])
def test_draft_tokens_outside_the_one_limit_are_refused(value, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--num-draft-tokens", value], env={})
    assert f"--num-draft-tokens must be in [1, 64], got {value}" in capsys.readouterr().err
    assert parse_settings(["--num-draft-tokens", "64"], env={}).speculation.num_draft_tokens == 64
    with pytest.raises(SystemExit):
        parse_settings(["--chain-tokens", "0"], env={})
    assert "--chain-tokens must be in [1, 64], got 0" in capsys.readouterr().err


def test_the_served_draft_lengths_are_a_requests_defaults() -> None:
    """One default per knob: what a request drafts when it asks nothing is what the flags say
    by default (a cap of 16 nodes a round, chains of 6, fixed k)."""
    assert parse_settings([], env={}).speculation.request_defaults == SpeculationParams()
    assert (SpeculationParams().num_draft_tokens, SpeculationParams().k) == (16, 6)
    assert not SpeculationParams().adaptive
    flags = ["--num-draft-tokens", "4", "--adaptive"]
    capped = parse_settings(flags, env={}).speculation.request_defaults
    assert (capped.num_draft_tokens, capped.k, capped.adaptive) == (4, 4, True)


def test_suffix_index_bounds_are_checked(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--suffix-index-tokens", "-1"], env={})
    assert "--suffix-index-tokens must be 0 or more, not -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--suffix-max-match", "1"], env={})
    assert "--suffix-max-match must be at least 2, not 1" in capsys.readouterr().err
    assert not parse_settings(["--no-suffix-index"], env={}).speculation.suffix_index


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--suffix-index-scope", "global"], "must be tenant or shared, not 'global'"),
        (["--suffix-index-tenants", "0"], "--suffix-index-tenants must be at least 1, not 0"),
    ],
)
def test_suffix_index_scope_and_tenants_are_checked(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(argv, env={})
    assert message in capsys.readouterr().err
    default = parse_settings([], env={}).speculation
    assert (default.suffix_index_scope, default.report_draft_source) == ("tenant", False)
    shared = parse_settings(["--suffix-index-scope", "shared"], env={}).speculation
    assert shared.suffix_index_scope == "shared" == SuffixIndexScope.SHARED


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--share-answers", "localhost:6379"], "must be a Redis URL starting redis://"),
        (["--share-answers", "http://user:secret@h/0"], "not 'h/0'"),  # never the password
        (["--share-answers", "redis://h:port/0"], "needs a host, an optional numeric port"),
        (["--share-answers", "redis:///0"], "needs a host"),
        (["--share-answers", "redis://h/db"], "an optional database number"),
        (["--share-answers", "redis://h/0", "--no-suffix-index"], "needs --suffix-index"),
        (["--share-answers-maxlen", "0"], "--share-answers-maxlen must be at least 1, not 0"),
        (["--share-answers-buffer", "0"], "--share-answers-buffer must be at least 1, not 0"),
    ],
)
def test_the_shared_answer_stream_url_and_bounds_are_checked(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(argv, env={})
    error = capsys.readouterr().err
    assert message in error and "secret" not in error
    assert parse_settings([], env={}).speculation.share_answers == ""  # off by default
    for url in ("redis://127.0.0.1:6379/2", "rediss://:pw@cache.internal", "unix:///run/r.sock"):
        assert parse_settings(["--share-answers", url], env={}).speculation.share_answers == url


def test_help_says_what_a_shared_suffix_index_reveals(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--help"], env={})
    text = " ".join(capsys.readouterr().out.split())
    assert "reveals to any caller" in text and "other callers' answers" in text


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--tree-budget", "0", "--tree-budget must be in [1, 64], not 0"),
        ("--tree-budget", "65", "--tree-budget must be in [1, 64], not 65"),
        ("--long-draft-tokens", "-1", "--long-draft-tokens must be in [0, 64], not -1"),
        ("--stream-stall-timeout-s", "0", "--stream-stall-timeout-s must be above 0, not 0.0"),
        ("--attention", "fast", "--attention must be auto, sdpa or grouped, not 'fast'"),
    ],
)
def test_tree_and_long_draft_bounds_are_checked(flag, value, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings([flag, value], env={})
    assert message in capsys.readouterr().err
    flags = ["--tree-budget", "1", "--no-recycled-predictions"]
    speculation = parse_settings(flags, env={}).speculation
    assert (speculation.tree_budget, speculation.recycled_predictions) == (1, False)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weights", "int2"], "--weights must be auto, bf16, int8, int4 or gguf, not 'int2'"),
        (["--weights", "int8", "--no-fast-step"], "int8 runs through the fast step: it cannot"),
        (["--weights", "int8", "--batch-invariant"], "cannot be combined with --batch-invariant"),
        (["--weights", "int8", "--dtype", "float16"], "not with --dtype float16"),
        (["--weights", "int4", "--no-fast-step"], "int4 runs through the fast step: it cannot"),
        (["--weights", "int4", "--batch-invariant"], "int4 cannot be combined with --batch-inv"),
        (["--weights", "int4", "--dtype", "float16"], "--weights int4 computes in bfloat16 or"),
        (["--weights", "gguf", "--batch-invariant"], "gguf cannot be combined with --batch-inv"),
        (["--weights", "gguf", "--dtype", "float16"], "--weights gguf computes in bfloat16 or"),
    ],
)
def test_quantized_weights_conflicts_are_refused_with_flags_named(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_settings(flags, env={})
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_weights_default_to_auto_and_take_int8_from_the_environment() -> None:
    assert parse_settings([], env={}).kernels.weights == "auto"
    assert parse_settings(["--weights", "gguf"], env={}).kernels.weights == Weights.GGUF
    assert parse_settings([], env={"KENSPEC_WEIGHTS": "int8"}).kernels.weights == "int8"
    flags = ["--weights", "int8", "--dtype", "float32"]
    assert parse_settings(flags, env={}).kernels.weights == Weights.INT8


def test_settings_are_grouped_as_the_engine_uses_them() -> None:
    settings = parse_settings(
        ["--grpc-port", "0", "--dtype", "bfloat16", "--max-queue", "3"], env={}
    )
    assert settings.server.grpc_port == 0 and settings.kernels.dtype == "bfloat16"
    assert settings.limits.max_queue == 3 and settings.model.has_draft
    assert list(GROUPS) == ["model", "kernels", "speculation", "server", "limits", "security"]
    assert FIELD_GROUPS["metrics_auth"] == "security" and FIELD_GROUPS["fast_step"] == "kernels"
    assert len({env_name(name) for name in FIELD_GROUPS}) == len(FIELD_GROUPS) == 91


def test_the_http_api_is_on_port_and_grpc_on_grpc_port(capsys) -> None:
    defaults = parse_settings([], env={}).server
    assert (defaults.port, defaults.grpc_port) == (8000, 50051)
    flags = parse_settings(["--port", "9000", "--grpc-port", "9001"], env={}).server
    assert (flags.port, flags.grpc_port) == (9000, 9001)
    assert capsys.readouterr().err == ""
    env = parse_settings([], env={"KENSPEC_PORT": "9100", "KENSPEC_GRPC_PORT": "9101"}).server
    assert (env.port, env.grpc_port) == (9100, 9101)


def test_the_names_before_0_2_still_set_the_http_port_with_a_warning(capsys) -> None:
    assert parse_settings(["--http-port", "9002"], env={}).server.port == 9002
    assert "--http-port is now --port" in capsys.readouterr().err
    assert parse_settings([], env={"KENSPEC_HTTP_PORT": "9003"}).server.port == 9003
    assert "KENSPEC_HTTP_PORT is now KENSPEC_PORT" in capsys.readouterr().err
    both = {"KENSPEC_HTTP_PORT": "9003", "KENSPEC_PORT": "9004"}
    assert parse_settings([], env=both).server.port == 9004  # the new name wins
    assert "[--http-port" not in parse_settings.__globals__["build_parser"]({}).format_usage()


def test_a_0_1_port_flag_that_now_collides_with_grpc_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings([], env={"KENSPEC_PORT": "50051"})  # gRPC's, in 0.1
    assert "since 0.2 --port is the HTTP API's and gRPC's is --grpc-port" in capsys.readouterr().err
    assert parse_settings(["--port", "0", "--grpc-port", "0"], env={}).server.port == 0


def test_an_api_key_is_a_secret_that_turns_authentication_on(capsys) -> None:
    settings = parse_settings([], env={"KENSPEC_API_KEY": "sk-local-1"})
    assert settings.security.api_key == "sk-local-1" and settings.security.authenticates
    assert "sk-local-1" not in repr(settings)
    assert not parse_settings([], env={}).security.authenticates
    assert parse_settings(["--metrics-auth", "token", "--api-key", "k"], env={}).security.api_key
    with pytest.raises(SystemExit):
        parse_settings(["--api-key", "two words"], env={})
    assert "--api-key must not contain whitespace" in capsys.readouterr().err


def test_modes_are_enums_that_compare_with_their_strings() -> None:
    settings = parse_settings(["--attention", "sdpa", "--log-level", "WARNING"], env={})
    assert settings.kernels.attention is AttentionMode.SDPA and settings.kernels.attention == "sdpa"
    assert settings.server.log_level is LogLevel.WARNING  # INFO as info, as logging names them
    assert settings.security.metrics_auth is MetricsAuth.AUTO and not MetricsAuth.AUTO.parts
    assert MetricsAuth("tls+token").parts == {"tls", "token"}
    made = Settings.of(weights="int4", suffix_index_scope="shared")  # strings, as flags give
    assert made.kernels.weights is Weights.INT4
    assert made.speculation.suffix_index_scope is SuffixIndexScope.SHARED


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--log-level", "loud"], {}, "--log-level must be debug, info, warning or error, not"),
        (["--log-format", "xml"], {}, "--log-format must be auto, console or json, not 'xml'"),
        ([], {"KENSPEC_LOG_FORMAT": "xml"}, "--log-format must be auto, console or json, not"),
        ([], {"KENSPEC_WEIGHTS": "int2"}, "--weights must be auto, bf16, int8, int4 or gguf, not"),
    ],
)
def test_modes_are_refused_naming_the_values_they_take(argv, env, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_settings(argv, env=env)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_settings_made_in_code_are_checked_as_flags_are() -> None:
    """Each group checks its own fields, and a whole Settings the rules between flags."""
    with pytest.raises(SettingsError, match=r"--tree-budget must be in \[1, 64\], not 0") as error:
        Settings.of(tree_budget=0)
    assert error.value.flag == "--tree-budget"
    with pytest.raises(SettingsError, match="int8 runs through the fast step") as error:
        Settings.of(weights="int8", fast_step=False)
    assert error.value.flag == "--weights"
    with pytest.raises(SettingsError, match="needs --api-key or --auth-tokens-file"):
        Settings().replace(metrics_auth="token")
    with pytest.raises(TypeError, match="no field colour"):
        Settings.of(colour="red")


def test_replace_routes_flat_names_to_their_groups() -> None:
    base = Settings.of(grpc_port=0, port=-1, dtype="float32")
    changed = base.replace(dtype="bfloat16", max_queue=4)
    assert (changed.kernels.dtype, changed.limits.max_queue) == ("bfloat16", 4)
    assert changed.server == base.server and changed.model is base.model  # others untouched
    assert base.kernels.dtype == "float32"


def test_help_is_grouped_by_the_settings_headings(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--help"], env={})
    text = capsys.readouterr().out
    starts = [text.index(f"\n{group}:\n") for group in GROUPS]
    assert starts == sorted(starts)
    ends = [*starts[1:], len(text)]
    flags = (
        "--gguf-cache",
        "--weights",
        "--tree-budget",
        "--port",
        "--max-queue",
        "--tls-cert",
    )
    for start, end, flag in zip(starts, ends, flags, strict=True):
        assert start < text.index(f"  {flag} ") < end
    assert "[env KENSPEC_WEIGHTS; default: auto]" in " ".join(text.split())

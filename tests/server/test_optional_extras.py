"""The server's optional parts (server.extras) without their packages: redis (--share-answers),
llguidance (grammars, tool calls) and OpenTelemetry (--otel). A missing package is simulated by
making its import fail (sys.modules[name] = None); the server must start and serve plain
requests, refuse a flag that needs the part at start-up, and a request that needs it with
UNIMPLEMENTED / HTTP 501, each naming the `pip install 'kenspec[...]'` to run."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from harness import server_process
from harness.server_process import ServerProcess
from kenspec.client import Client, KenspecError
from kenspec.server.answer_stream import AnswerStream, StreamSettings
from kenspec.server.engine.extras import ExtraMissing, missing_package
from kenspec.server.engine.grammar import GrammarCompiler, GrammarSpec
from kenspec.server.engine.tenant_index import TenantSuffixIndex
from kenspec.server.extras import check_extras
from kenspec.server.metrics import Metrics
from kenspec.server.serving import failure_of
from kenspec.server.settings import parse_settings
from tests import tiny

ROOT = Path(__file__).resolve().parents[2]
SHARE = ["--share-answers", "redis://127.0.0.1:1/0"]
REGEX = {"type": "regex", "regex": "(red|blue)!"}
TIMEOUT = 60


def block(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Imports of `package` and its modules fail from now on, as if it were not installed."""
    for name in list(sys.modules):
        if name == package or name.startswith(f"{package}."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)


def test_share_answers_without_redis_is_refused_naming_the_extra(monkeypatch) -> None:
    settings = parse_settings(SHARE)
    check_extras(settings)  # installed: nothing to refuse
    block(monkeypatch, "redis")
    assert missing_package("redis") == "redis"
    with pytest.raises(ExtraMissing) as refused:
        check_extras(settings)
    message = str(refused.value)
    assert "--share-answers" in message and "pip install 'kenspec[redis]'" in message
    assert isinstance(refused.value, ValueError)  # the start-up error path's
    check_extras(parse_settings([]))  # without the flag, no redis is needed


def test_otel_without_opentelemetry_is_refused_naming_the_extra(monkeypatch) -> None:
    check_extras(parse_settings(["--otel"]))
    block(monkeypatch, "opentelemetry")
    with pytest.raises(ExtraMissing, match=r"--otel .*pip install 'kenspec\[otel\]'"):
        check_extras(parse_settings(["--otel"]))
    check_extras(parse_settings([]))


def test_a_missing_grammar_part_is_logged_at_start_up_not_refused(monkeypatch) -> None:
    with capture_logs() as logs:
        check_extras(parse_settings([]))
    assert not [e for e in logs if e["event"] == "optional_part_missing"]
    block(monkeypatch, "llguidance")
    with capture_logs() as logs:
        check_extras(parse_settings([]))
    [warning] = [e for e in logs if e["event"] == "optional_part_missing"]
    assert warning["extra"] == "grammar" and warning["missing"] == "llguidance"
    assert warning["install"] == "pip install 'kenspec[grammar]'"


def test_the_answer_stream_without_redis_names_the_extra(monkeypatch) -> None:
    settings = StreamSettings("redis://127.0.0.1:1/0", "0" * 16, vocab_size=320)
    AnswerStream(settings, TenantSuffixIndex(), Metrics())  # installed: made (never started)
    block(monkeypatch, "redis")
    with pytest.raises(ExtraMissing, match=r"pip install 'kenspec\[redis\]'"):
        AnswerStream(settings, TenantSuffixIndex(), Metrics())


def test_a_grammar_without_llguidance_is_refused_before_its_compile(monkeypatch) -> None:
    tokenizer = tiny.build_byte_tokenizer()
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer))
    compiler.start(GrammarSpec("regex", "(red|blue)!"))  # installed: compiled
    block(monkeypatch, "llguidance")
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer))
    with pytest.raises(ExtraMissing) as refused:
        compiler.start(GrammarSpec("lark", 'start: "a"', field="tools"))
    message = str(refused.value)
    assert message.startswith("tools: structured output")
    assert "llguidance is missing" in message and "pip install 'kenspec[grammar]'" in message


def test_a_missing_part_is_unimplemented_not_the_callers_fault() -> None:
    error = ExtraMissing("response_format: structured output", "grammar", "llguidance")
    failure = failure_of(error, "r-1")
    assert (failure.code, failure.http_status) == (grpc.StatusCode.UNIMPLEMENTED, 501)
    assert failure.message == str(error)  # what to install, not "internal error"


# A server whose interpreter cannot import redis, llguidance nor OpenTelemetry.
WITHOUT_EXTRAS = """
import sys
for name in ("redis", "llguidance", "opentelemetry"):
    sys.modules[name] = None  # as if not installed
from kenspec.server.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


SERVER_COMMAND = server_process.server_command


def without_extras(args: list[str]) -> list[str]:
    """harness.server_process's command, run by WITHOUT_EXTRAS instead of `-m kenspec.server`."""
    command = SERVER_COMMAND(args)
    flags = command[command.index("kenspec.server") + 1 :]
    return [sys.executable, "-c", WITHOUT_EXTRAS, *flags]


@pytest.fixture(scope="module")
def bare_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """The tiny model served without the optional packages (gRPC and HTTP)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server_process, "server_command", without_extras)
        flags = ["--model", str(tiny_model_dir), "--draft", "none", "--device", "cpu"]
        flags += ["--dtype", "float32", "--threads", "1", "--served-model-name", "tiny"]
        process = ServerProcess([*flags, "--port", "0"], timeout=120)
    yield process
    process.stop()


def post(server: ServerProcess, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}{path}",
        data=json.dumps({"model": "tiny", **body}).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_without_the_packages_plain_requests_are_served_grammars_refused(bare_server) -> None:
    with Client(bare_server.address, timeout=TIMEOUT) as client:
        assert client.generate_text("Hello", max_new_tokens=4).usage.completion_tokens >= 1
        with pytest.raises(KenspecError) as refused:
            client.generate_text("Hello", max_new_tokens=4, response_format=REGEX)
        assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert "pip install 'kenspec[grammar]'" in refused.value.message
        assert refused.value.message.startswith("response_format: structured output")
        assert client.generate_text("Hello", max_new_tokens=4).usage.completion_tokens >= 1

    status, body = post(bare_server, "/v1/completions", {"prompt": "Hi", "response_format": REGEX})
    assert status == 501, body
    assert "pip install 'kenspec[grammar]'" in body["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "tools": tools}
    status, body = post(bare_server, "/v1/chat/completions", {**chat, "tool_choice": "required"})
    assert status == 501, body
    assert body["error"]["message"].startswith("tools: structured output")
    status, body = post(bare_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1, body


def test_without_the_packages_the_start_up_says_what_grammars_need(bare_server) -> None:
    warning = bare_server.logged("optional_part_missing")
    assert warning is not None and warning["install"] == "pip install 'kenspec[grammar]'"


def test_share_answers_without_redis_stops_the_server_before_it_loads(tmp_path) -> None:
    """Refused before the model loads: this one does not exist, and is never looked at."""
    missing_model = tmp_path / "no-such-model"
    command = without_extras(["--model", str(missing_model), "--draft", "none", *SHARE])
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    [failed] = [e for e in events if e.get("event") == "startup_failed"]
    assert "--share-answers" in failed["error"]
    assert "pip install 'kenspec[redis]'" in failed["error"]
    assert "Traceback" not in output

"""The `kenspec` command line, run in-process through `main([...])`."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.client.cli import main

if TYPE_CHECKING:
    from conftest import FakeServer

TIMEOUT = ["--timeout", "10"]  # no CLI test can hang on a stream

ROOT = Path(__file__).resolve().parents[2]  # the repository, where `client` lives


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([*TIMEOUT, *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err


def test_streams_text_then_prints_stats(
    threaded_fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "-a", threaded_fake.address, "world")

    assert code == 0
    assert out == "Hello world"  # not a terminal: no newline added
    stats = (
        r"completion_tokens=7 tokens/s=(\d+\.\d|n/a) acceptance=4/6 \(66\.7%\) rounds=3"
        r" mode_switches=2 finish_reason=length\n"
    )
    assert re.fullmatch(stats, err), err


def test_flags_map_onto_the_request(
    threaded_fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["-a", threaded_fake.address, "--chat", "--system", "be brief", "-t", "0.8"]
    argv += ["--top-k", "5", "--top-p", "0.5", "--seed", "7", "-n", "9", "--ignore-eos"]
    argv += ["--stop", "a", "--stop", "b", "--speculation", "off", "-k", "3", "--no-adaptive"]
    argv += ["--draft-context", "--request-id", "cli-1", "--token", "tok", "hello"]
    code, _, _ = run(capsys, *argv)

    assert code == 0
    (request,) = threaded_fake.servicer.requests
    assert isinstance(request, pb.GenerateRequest)
    turns = [(m.role, m.content) for m in request.messages.messages]
    assert turns == [("system", "be brief"), ("user", "hello")]
    assert request.sampling.temperature == pytest.approx(0.8)
    assert request.sampling.top_p == pytest.approx(0.5)
    assert (request.sampling.top_k, request.sampling.seed) == (5, 7)
    assert request.stopping.max_new_tokens == 9 and request.stopping.ignore_eos
    assert list(request.stopping.stop) == ["a", "b"]
    assert request.speculation.mode == pb.SPECULATION_MODE_OFF
    assert request.speculation.num_draft_tokens == 3
    assert request.speculation.HasField("adaptive") and not request.speculation.adaptive
    assert request.speculation.draft_context == pb.DRAFT_CONTEXT_ON
    assert request.request_id == "cli-1"
    assert threaded_fake.servicer.metadata[0]["authorization"] == "Bearer tok"


def test_request_field_flags_map_onto_the_request(
    threaded_fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["-a", threaded_fake.address, "--min-p", "0.1", "--presence-penalty", "0.5"]
    argv += ["--frequency-penalty", "-0.5", "--repetition-penalty", "1.2"]
    argv += ["--logit-bias", "5=-100", "--logit-bias", "9=2.5", "--choices", "2"]
    argv += ["--logprobs", "3", "hello"]
    run(capsys, *argv)

    (request,) = threaded_fake.servicer.requests
    assert isinstance(request, pb.GenerateRequest)
    sampling = request.sampling
    assert sampling.min_p == pytest.approx(0.1)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
    assert sampling.repetition_penalty == pytest.approx(1.2)
    assert dict(sampling.logit_bias) == {5: -100.0, 9: 2.5}
    assert (request.n, request.logprobs, request.top_logprobs) == (2, True, 3)


def test_a_bad_logit_bias_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--logit-bias", "five=1", "hi")
    assert code == 2 and out == "" and "ID=AMOUNT" in err


def test_json_prints_one_object_per_round(
    threaded_fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "-a", threaded_fake.address, "--json", "world")

    assert code == 0
    rounds = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in rounds] == ["Hel", "lo", " world"]
    assert rounds[0]["round"]["mode"] == "ROUND_MODE_SPECULATIVE"
    assert rounds[0]["finish_reason"] == "FINISH_REASON_UNSPECIFIED"
    assert rounds[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert rounds[-1]["usage"]["completion_tokens"] == 7
    assert "usage" not in rounds[0]
    assert "finish_reason=length" in err


def test_prompt_from_stdin(
    threaded_fake: FakeServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\n"))
    code, out, _ = run(capsys, "-a", threaded_fake.address, "-")

    assert code == 0
    assert out == "Hello from stdin"
    assert threaded_fake.servicer.requests[0].prompt == "from stdin"


def test_info_and_tokenize_print_json(
    threaded_fake: FakeServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KENSPEC_ADDRESS", threaded_fake.address)
    code, out, _ = run(capsys, "--info")
    assert code == 0
    assert json.loads(out)["model"] == "fake"

    code, out, _ = run(capsys, "--tokenize", "ab")
    assert code == 0
    assert json.loads(out) == {"token_ids": [97, 98], "tokens": ["a", "b"], "token_count": 2}


def test_server_error_exits_1_with_code_and_message(
    threaded_fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "-a", threaded_fake.address, "__invalid__")

    assert code == 1
    assert out == ""
    assert err == f"error: INVALID_ARGUMENT: {threaded_fake.servicer.INVALID_MESSAGE}\n"


def test_unreachable_server_exits_1(dead_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "-a", dead_address, "hi")

    assert code == 1
    assert err.startswith(f"error: UNAVAILABLE: cannot reach the kenspec server at {dead_address}")


@pytest.mark.parametrize(
    "argv",
    [
        ["--top-k", "many", "hi"],
        ["--speculation", "sometimes", "hi"],
        ["--info", "--tokenize"],
        ["--tls-cert", "client.pem", "hi"],  # a certificate without its key
        ["-a", "127.0.0.1:1,[::1]:2", "hi"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *argv)

    assert code == 2
    assert out == ""
    assert "error: INVALID_ARGUMENT: " in err


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")

    assert code == 0
    flags = "--address --chat --system --json --tokenize --info --token --tls --tls-ca --tls-cert"
    flags += " --tls-key --tls-server-name --timeout --temperature --top-k --top-p --seed"
    flags += " --max-new-tokens --stop --ignore-eos --speculation --num-draft-tokens"
    flags += " --adaptive --draft-context --request-id KENSPEC_ADDRESS KENSPEC_TOKEN"
    flags += " --min-p --presence-penalty --frequency-penalty --repetition-penalty --logit-bias"
    flags += " --choices --logprobs"
    assert [flag for flag in flags.split() if flag not in out] == []


def test_python_dash_m_client_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kenspec.client", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0
    assert "usage: kenspec" in result.stdout


def test_generate_is_the_default_command_named(
    threaded_fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "-a", threaded_fake.address, "world")
    assert (code, out) == (0, "Hello world")
    assert main(["generate", *TIMEOUT, "-a", threaded_fake.address, "world"]) == 0
    assert capsys.readouterr().out == "Hello world"


def test_serve_runs_the_server_with_the_rest_of_the_line(monkeypatch) -> None:
    import kenspec.server.__main__ as server_main

    seen: list[list[str]] = []
    monkeypatch.setattr(server_main, "main", lambda argv: seen.append(argv) or 7)
    assert main(["serve", "--model", "m", "--port", "0"]) == 7
    assert seen == [["--model", "m", "--port", "0"]]


def test_serve_without_the_server_installed_says_what_to_install(
    monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kenspec.server.__main__", None)  # as in kenspec-client
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: FAILED_PRECONDITION: `kenspec serve` needs the server")
    assert "pip install kenspec" in err and "Traceback" not in err

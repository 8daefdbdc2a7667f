"""The real entry points in subprocesses: `kenspec serve` drains on SIGTERM; the client CLI."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from gguf import GGMLQuantizationType

from harness.server_process import server_command
from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from tests.gguf_files import write_header_only_gguf
from tests.server.engine.drafts import reference_greedy

REPO = Path(__file__).resolve().parents[2]


STREAM_TIMEOUT = 120  # seconds; bounds a stream that a passing run finishes long before


@pytest.fixture
def server_process(tiny_server):
    # The drain waits for in-flight streams longer than their clients do: a stream is never
    # cut by the grace period, however slow the machine; a hang ends at the client's deadline.
    process = tiny_server("--grace-period-s", str(5 * STREAM_TIMEOUT))
    yield process
    process.stop()


def test_sigterm_drains_in_flight_streams_then_exits_zero(server_process, tiny_target) -> None:
    """SIGTERM under load: every stream in flight finishes whole, then the process exits 0."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server_process.port}")
    stub = pb_grpc.GeneratorStub(channel)
    prompts = ["The quick brown fox", "Hello world", "one pass", "over the"]
    streams = []
    for prompt in prompts:
        request = pb.GenerateRequest(
            prompt=prompt,
            stopping=pb.StoppingCriteria(max_new_tokens=120),
            speculation=pb.SpeculationParameters(mode=pb.SPECULATION_MODE_OFF),
        )
        stream = stub.Generate(request, timeout=STREAM_TIMEOUT)
        streams.append((prompt, stream, list(next(stream).token_ids)))
    server_process.process.send_signal(signal.SIGTERM)
    server_process.wait_for("draining")
    refused = stub.Generate(pb.GenerateRequest(prompt="late"), timeout=10)
    with pytest.raises(grpc.RpcError):
        list(refused)  # no new calls once draining
    for prompt, stream, tokens in streams:
        for response in stream:
            tokens.extend(response.token_ids)
            last = response
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        expected = reference_greedy(tiny_target, tiny_target.encode_prompt(prompt), 120)
        assert tokens == expected
    server_process.wait_for("stopped")
    assert server_process.process.wait(30) == 0
    channel.close()


def run_cli(port: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kenspec.client", "--address", f"127.0.0.1:{port}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_client_cli_against_a_running_server(server_process, tiny_target) -> None:
    result = run_cli(server_process.port, "-n", "12", "The quick brown fox")
    assert result.returncode == 0, result.stderr
    expected = reference_greedy(tiny_target, tiny_target.encode_prompt("The quick brown fox"), 12)
    assert result.stdout.rstrip("\n") == tiny_target.tokenizer.decode(expected)
    assert "completion_tokens=12" in result.stderr and "finish_reason=length" in result.stderr

    as_json = run_cli(server_process.port, "--json", "-n", "5", "Hello world")
    rounds = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert sum(len(r.get("token_ids", [])) for r in rounds) == 5
    assert rounds[-1]["usage"]["completion_tokens"] == 5

    info = run_cli(server_process.port, "--info")
    assert json.loads(info.stdout)["vocab_size"] == tiny_target.vocab_size

    bad = run_cli(server_process.port, "--temperature", "-1", "x")
    assert bad.returncode == 1
    assert "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_bad_model_path_fails_startup_with_a_clear_message(tmp_path) -> None:
    result = subprocess.run(
        server_command(["--model", str(tmp_path / "missing"), "--draft", "none"]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_an_unsupported_gguf_fails_startup_with_its_reason(tmp_path) -> None:
    gguf = write_header_only_gguf(tmp_path / "q.gguf", "llama", GGMLQuantizationType.Q8_1)
    result = subprocess.run(
        server_command(["--model", str(gguf), "--draft", "none", "--gguf-cache", str(tmp_path)]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "tensor types Q8_1 cannot be dequantized" in result.stderr
    assert "Traceback" not in result.stderr

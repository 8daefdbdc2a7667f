"""Real nginx and Prometheus (Debian packages) with the repo's configs, in front of / scraping
kenspec server processes on loopback. .ci/run installs both.

The replicas and nginx come from conftest.py. Nothing here polls: a cancellation has reached a
replica when that replica logs the request done, and Prometheus has scraped when it
remote-writes what it scraped to a receiver in the test.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from tests.deploy.conftest import (
    REPO,
    TIMEOUT,
    UPSTREAM_HEADER,
    LogLines,
    free_port,
    require,
    substitute,
)


def stub_for(port: int) -> pb_grpc.GeneratorStub:
    return pb_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def test_streams_through_nginx_reach_both_replicas_and_complete(
    replicas, nginx, scrape, tiny_model_dir
) -> None:
    model = tiny_model_dir.name  # the model_name label: the served model's id

    def requests_ok(metrics_port: int) -> float:
        samples = scrape(metrics_port)
        return samples.value(
            "kenspec_requests_total",
            model_name=model,
            api="grpc",
            finish_reason="length",
            code="OK",
        )

    before = [requests_ok(metrics) for _, metrics in replicas]
    stub = stub_for(nginx[0])  # one channel, one HTTP/2 connection to nginx
    for index in range(6):
        request = pb.GenerateRequest(
            prompt=f"Hello world {index}", stopping=pb.StoppingCriteria(max_new_tokens=8)
        )
        responses = list(stub.Generate(request, timeout=TIMEOUT))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.token_ids) for r in responses) == 8
    # Each call's status came after its server had counted it: nothing to wait for.
    served = [requests_ok(metrics) - b for (_, metrics), b in zip(replicas, before, strict=True)]
    assert sum(served) == 6
    assert all(count >= 1 for count in served), served  # balanced per request


def test_cancellation_through_nginx_reaches_the_server(
    replicas, nginx, scrape, tiny_model_dir
) -> None:
    stub = stub_for(nginx[0])
    request = pb.GenerateRequest(
        prompt="The quick brown fox",
        stopping=pb.StoppingCriteria(max_new_tokens=390),
        speculation=pb.SpeculationParameters(mode=pb.SPECULATION_MODE_OFF),
    )
    call = stub.Generate(request, timeout=TIMEOUT)
    first = next(call)
    upstream = dict(call.initial_metadata())[UPSTREAM_HEADER]
    call.cancel()
    ((replica, metrics),) = [(p, m) for p, m in replicas if upstream == f"127.0.0.1:{p.port}"]
    while (done := replica.wait_for("request_done", TIMEOUT)).get("request_id") != first.request_id:
        pass  # an earlier request's
    assert done["outcome"] == "cancelled"
    # A later call on the replica's event loop: the cancelled call's clean-up (its slot, its
    # count) ran in the loop turn that logged it, before this one was served.
    pb_grpc.GeneratorStub(grpc.insecure_channel(replica.address)).GetModelInfo(
        pb.GetModelInfoRequest(), timeout=TIMEOUT
    )
    samples = scrape(metrics)
    cancelled = {"api": "grpc", "finish_reason": "none", "code": "CANCELLED"}
    assert samples.value("kenspec_requests_total", model_name=tiny_model_dir.name, **cancelled) >= 1
    assert samples.value("kenspec_active_streams") == 0


def test_openai_streaming_chat_through_nginx(replicas, nginx) -> None:
    """The compose set-up's HTTP port: the official client streams through the proxy, one
    event per round, from whichever replica nginx picks."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{nginx[1]}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    )
    (model,) = [card.id for card in client.models.list()]
    for index in range(2):
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Hello {index}"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        *rounds, usage = list(stream)
        assert usage.usage.completion_tokens == 8
        assert len(rounds) == usage.model_extra["kenspec"]["rounds"]
        assert rounds[-1].choices[0].finish_reason == "length"
    client.close()


class _RemoteWrites(http.server.BaseHTTPRequestHandler):
    """Receives Prometheus' remote writes: each means it scraped and stored samples."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(204)
        self.end_headers()
        self.server.written.set()  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:
        pass


def test_prometheus_scrapes_the_server_with_the_repo_config(replicas, tmp_path) -> None:
    (process, metrics_port) = replicas[0]
    stub = stub_for(process.port)
    list(  # counted before Prometheus starts: its first scrape sees it
        stub.Generate(
            pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingCriteria(max_new_tokens=4)),
            timeout=TIMEOUT,
        )
    )
    config = (REPO / "deploy" / "prometheus.yml").read_text()
    result = prometheus_query(config, metrics_port, tmp_path, "kenspec_requests_total")
    assert any(float(r["value"][1]) >= 1 for r in result)


def test_prometheus_scrapes_with_the_token_of_the_tokens_overlay(tiny_server, tmp_path) -> None:
    """deploy/compose.tokens.yml: the replicas' /metrics ask for the token (--metrics-auth
    auto), and deploy/prometheus.tokens.yml sends it from the secret's file."""
    token = tmp_path / "token"
    token.write_text("scrape-token\n")
    metrics_port = free_port()
    process = tiny_server("--metrics-port", str(metrics_port), "--auth-tokens-file", str(token))
    try:
        refused = urllib.request.Request(f"http://127.0.0.1:{metrics_port}/metrics")
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(refused, timeout=TIMEOUT)
        assert error.value.code == 401
        config = (REPO / "deploy" / "prometheus.tokens.yml").read_text()
        config = substitute(
            "credentials_file: /run/secrets/kenspec_token", f"credentials_file: {token}", config
        )
        result = prometheus_query(config, metrics_port, tmp_path, "kenspec_active_streams")
        assert [float(r["value"][1]) for r in result] == [0.0]
    finally:
        process.stop()


def prometheus_query(config: str, metrics_port: int, tmp_path: Path, metric: str) -> list[dict]:
    """Run Prometheus with the repo's `config` pointed at one replica's metrics; once it has
    scraped and stored them, the series of `metric` it returns for the kenspec job."""
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RemoteWrites)
    receiver.written = threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    config = substitute(
        r"dns_sd_configs:\n(\s+- .*\n)(\s+\w+: .*\n)+",
        f"static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n",
        config,
    )
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
    config += (
        "remote_write:\n"
        f"  - url: http://127.0.0.1:{receiver.server_address[1]}/write\n"
        "    queue_config: {batch_send_deadline: 100ms}\n"
        "    metadata_config: {send: false}\n"
    )
    (tmp_path / "prometheus.yml").write_text(config)
    port = free_port()
    prometheus = subprocess.Popen(
        [
            require("prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        LogLines(prometheus.stderr).wait_for("Server is ready to receive web requests")
        # The only job is kenspec: a remote write follows its first scrape, stored and queryable.
        assert receiver.written.wait(TIMEOUT), "Prometheus wrote nothing it scraped"  # type: ignore[attr-defined]
        query = urllib.parse.urlencode({"query": f'{metric}{{job="kenspec"}}'})
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=TIMEOUT
        ) as response:
            result = json.load(response)["data"]["result"]
        assert result, "Prometheus returned no kenspec series"
        assert {r["metric"]["instance"] for r in result} == {f"127.0.0.1:{metrics_port}"}
        return result
    finally:
        prometheus.terminate()
        prometheus.wait(10)
        receiver.shutdown()
        receiver.server_close()

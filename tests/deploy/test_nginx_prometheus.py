"""Real nginx and Prometheus (Debian packages) with the repo's configs, in front of / scraping
kenspec server processes on loopback. .ci/run installs both."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

from kenspec_api import generator_pb2 as pb
from kenspec_api import generator_pb2_grpc as pb_grpc
from tests.service.test_metrics import scrape, value
from tests.service.test_process import tiny_server

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {port}")


def require(binary: str) -> str:
    path = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin")
    assert path, f"{binary} is not installed; .ci/run installs it (apt-get install {binary})"
    return path


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tiny_draft_path):
    metrics = [free_port(), free_port()]
    processes = [
        tiny_server(tiny_model_dir, tiny_draft_path, "--metrics-port", str(port))
        for port in metrics
    ]
    yield list(zip(processes, metrics, strict=True))
    for process in processes:
        process.stop()


@pytest.fixture(scope="module")
def nginx(replicas, tmp_path_factory):
    directory = tmp_path_factory.mktemp("nginx")
    port = free_port()
    upstreams = "".join(f"server 127.0.0.1:{p.port};\n        " for p, _ in replicas)
    config = (REPO / "deploy" / "nginx.conf").read_text()
    config = re.sub(r"server kenspec:\d+;\n\s*", upstreams, config)
    config = re.sub(r"listen \d+ http2;", f"listen 127.0.0.1:{port} http2;", config)
    config = config.replace("/tmp/kenspec-nginx", str(directory / "nginx"))
    (directory / "nginx.conf").write_text(config)
    process = subprocess.Popen(
        [
            require("nginx"),
            "-c",
            str(directory / "nginx.conf"),
            "-p",
            str(directory),
            "-g",
            "daemon off;",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_port(port)
    except TimeoutError:
        process.kill()
        raise AssertionError(f"nginx did not start: {process.communicate()[1]}") from None
    yield port
    process.terminate()
    process.wait(10)


def stub_for(port: int) -> pb_grpc.GeneratorStub:
    return pb_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def requests_ok(metrics_port: int) -> float:
    return value(scrape(metrics_port), "kenspec_requests_total", finish_reason="length", code="OK")


def test_streams_through_nginx_reach_both_replicas_and_complete(replicas, nginx) -> None:
    before = [requests_ok(metrics) for _, metrics in replicas]
    stub = stub_for(nginx)  # one channel, one HTTP/2 connection to nginx
    for index in range(6):
        request = pb.GenerateRequest(
            prompt=f"Hello world {index}", stopping=pb.StoppingCriteria(max_new_tokens=8)
        )
        responses = list(stub.Generate(request, timeout=60))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.token_ids) for r in responses) == 8
    served = [requests_ok(metrics) - b for (_, metrics), b in zip(replicas, before, strict=True)]
    assert sum(served) == 6
    assert all(count >= 1 for count in served), served  # balanced per request


def test_cancellation_through_nginx_reaches_the_server(replicas, nginx) -> None:
    stub = stub_for(nginx)
    request = pb.GenerateRequest(
        prompt="The quick brown fox",
        stopping=pb.StoppingCriteria(max_new_tokens=390),
        speculation=pb.SpeculationParameters(mode=pb.SPECULATION_MODE_OFF),
    )
    call = stub.Generate(request, timeout=60)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        samples = [scrape(metrics) for _, metrics in replicas]
        cancelled = sum(
            value(s, "kenspec_requests_total", finish_reason="none", code="CANCELLED")
            for s in samples
        )
        active = sum(value(s, "kenspec_active_streams") for s in samples)
        if cancelled >= 1 and active == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"cancellation did not reach a replica: {cancelled=} {active=}")


def test_prometheus_scrapes_the_server_with_the_repo_config(replicas, tmp_path) -> None:
    (process, metrics_port) = replicas[0]
    config = (REPO / "deploy" / "prometheus.yml").read_text()
    config = re.sub(
        r"dns_sd_configs:\n(\s+- .*\n)(\s+\w+: .*\n)+",
        f"static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n",
        config,
    )
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
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
        stderr=subprocess.DEVNULL,
    )
    try:
        stub = stub_for(process.port)
        list(
            stub.Generate(
                pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingCriteria(max_new_tokens=4)),
                timeout=60,
            )
        )
        query = urllib.parse.urlencode({"query": 'kenspec_requests_total{job="kenspec"}'})
        deadline = time.monotonic() + 60
        result: list = []
        while time.monotonic() < deadline and not result:
            time.sleep(1)
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=5
                ) as response:
                    result = json.load(response)["data"]["result"]
            except OSError:
                continue
        assert result, "Prometheus returned no kenspec series"
        assert any(float(r["value"][1]) >= 1 for r in result)
        assert {r["metric"]["instance"] for r in result} == {f"127.0.0.1:{metrics_port}"}
    finally:
        prometheus.terminate()
        prometheus.wait(10)

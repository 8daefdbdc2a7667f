"""/metrics as a hostile client finds it: on loopback unless told otherwise, behind the APIs'
token and TLS (--metrics-auth), and bounded (an idle or trickling client is dropped after the
read timeout, connections past the cap are closed at once). Real sockets on 127.0.0.x."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from kenspec.server.metrics_http import MetricsAccess, MetricsEndpoint
from kenspec.server.settings import parse_settings

TIMEOUT = 60.0  # seconds; bounds waits that a passing run never reaches


def get(
    port: int,
    *,
    host: str = "127.0.0.1",
    token: str = "",
    context: ssl.SSLContext | None = None,
    path: str = "/metrics",
) -> bytes:
    """The whole answer to one GET (the endpoint closes after answering); b"" when the
    connection is closed or reset without one."""
    head = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n"
    head += f"Authorization: Bearer {token}\r\n" if token else ""
    with socket.create_connection((host, port), timeout=TIMEOUT) as raw:
        sock = context.wrap_socket(raw, server_hostname="localhost") if context else raw
        received = b""
        try:
            sock.sendall((head + "\r\n").encode())
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        return received


def unanswered(port: int, **request) -> bool:
    """Whether a GET gets no HTTP answer at all: refused in the handshake, or dropped."""
    try:
        return not get(port, **request).startswith(b"HTTP/")
    except OSError:  # ssl.SSLError (an alert), a reset, a broken pipe
        return True


def status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:100]
    return int(answer.split(b" ", 2)[1])


def client_context(pki, *, cert: str = "") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if cert:
        context.load_cert_chain(str(pki[f"{cert}_cert"]), str(pki[f"{cert}_key"]))
    return context


@pytest.fixture
def tokens_file(tmp_path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# scrapers\nscrape-token\n")
    return path


def test_metrics_listen_on_loopback_unless_told_otherwise() -> None:
    assert parse_settings([], {}).server.metrics_host == "127.0.0.1"
    everywhere = parse_settings([], {"KENSPEC_HOST": "0.0.0.0"})
    assert everywhere.server.metrics_host == "127.0.0.1"  # the APIs' --host does not carry over
    assert parse_settings(["--metrics-host", "0.0.0.0"], {}).server.metrics_host == "0.0.0.0"


async def test_metrics_listen_on_metrics_host_not_host(start_server) -> None:
    server, _ = await start_server(host="127.0.0.1", metrics_port=0, metrics_host="127.0.0.2")
    assert status(get(server.metrics_port, host="127.0.0.2")) == 200
    with pytest.raises(ConnectionRefusedError):
        get(server.metrics_port, host="127.0.0.1")


async def test_tokens_of_the_server_guard_its_metrics(start_server, tokens_file) -> None:
    server, _ = await start_server(auth_tokens_file=str(tokens_file), metrics_port=0)
    refused = get(server.metrics_port)
    assert status(refused) == 401 and b"WWW-Authenticate: Bearer" in refused
    assert status(get(server.metrics_port, token="wrong")) == 401
    assert status(get(server.metrics_port, token="scrape-token-x")) == 401
    answer = get(server.metrics_port, token="scrape-token")
    assert status(answer) == 200 and b"kenspec_requests_total" in answer
    assert status(get(server.metrics_port, token="scrape-token", path="/other")) == 404


async def test_metrics_auth_none_opens_them_again(start_server, tokens_file) -> None:
    server, _ = await start_server(
        auth_tokens_file=str(tokens_file), metrics_port=0, metrics_auth="none"
    )
    assert status(get(server.metrics_port)) == 200


async def test_tls_of_the_server_serves_its_metrics(start_server, pki) -> None:
    server, _ = await start_server(
        tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]), metrics_port=0
    )
    answer = get(server.metrics_port, context=client_context(pki))
    assert status(answer) == 200 and b"kenspec_active_streams" in answer
    assert unanswered(server.metrics_port)  # plaintext


async def test_tls_and_token_together_and_client_certificates(
    start_server, pki, tokens_file
) -> None:
    server, _ = await start_server(
        tls_cert=str(pki["server_cert"]),
        tls_key=str(pki["server_key"]),
        tls_client_ca=str(pki["ca"]),
        auth_tokens_file=str(tokens_file),
        metrics_port=0,
        metrics_auth="tls+token",
    )
    port = server.metrics_port
    with_cert = client_context(pki, cert="client")
    assert status(get(port, context=with_cert)) == 401
    assert status(get(port, context=with_cert, token="scrape-token")) == 200
    for context in (client_context(pki), client_context(pki, cert="stranger")):
        assert unanswered(port, context=context, token="scrape-token")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics-auth", "token"], "needs --api-key or --auth-tokens-file"),
        (["--metrics-auth", "tls"], "needs --tls-cert and --tls-key"),
        (["--metrics-auth", "basic"], "must be one of auto, none, token, tls, tls+token"),
    ],
)
def test_metrics_auth_needs_what_it_names(flags, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(flags, {})
    assert message in capsys.readouterr().err


@pytest.fixture
def endpoint():
    """start(read_timeout_s, max_connections) -> the port of a plaintext endpoint."""
    registry = CollectorRegistry()
    Counter("kenspec_test_total", "a counter", registry=registry).inc()
    started: list[MetricsEndpoint] = []

    def start(read_timeout_s: float, max_connections: int = 16) -> tuple[MetricsEndpoint, int]:
        server = MetricsEndpoint(
            registry,
            MetricsAccess(),
            read_timeout_s=read_timeout_s,
            max_connections=max_connections,
        )
        started.append(server)
        return server, server.start("127.0.0.1", 0)

    yield start
    for server in started:
        server.close()


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server ends the connection (EOF or reset) within TIMEOUT, unanswered."""
    sock.settimeout(TIMEOUT)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_and_trickling_clients_are_dropped(endpoint) -> None:
    _, port = endpoint(read_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", port)) as idle:
        assert closed_by_server(idle)
    with socket.create_connection(("127.0.0.1", port)) as trickle:
        trickle.sendall(b"GET /metr")  # and nothing more
        assert closed_by_server(trickle)
    assert status(get(port)) == 200  # served as ever


def test_connections_past_the_cap_are_closed_at_once(endpoint) -> None:
    """The read timeout (10 minutes) is far past the wait: only the cap can close the third."""
    server, port = endpoint(read_timeout_s=600.0, max_connections=2)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        wait_for_connections(server, 2)  # both accepted and counted, on the endpoint's thread
        with socket.create_connection(("127.0.0.1", port)) as third:
            assert closed_by_server(third)
    finally:
        for sock in held:
            sock.close()
    wait_for_connections(server, 0)
    assert status(get(port)) == 200


def wait_for_connections(server: MetricsEndpoint, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while server.connections != count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.connections == count


def test_heads_that_are_not_http_get_4xx(endpoint) -> None:
    _, port = endpoint(read_timeout_s=10.0)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(sock.recv(65536)) == 405
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(b"garbage\r\n\r\n")
        assert status(sock.recv(65536)) == 400
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n")
        except OSError:  # reset while sending: dropped already
            return
        assert closed_by_server(sock)  # a head past 16 KiB: dropped

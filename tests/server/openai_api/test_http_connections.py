"""The HTTP API's connection bounds, over real sockets on loopback: a cap on connections that
idle ones cannot fill against a real client, a cap on requests in flight, and timeouts on
headers that are slow, never sent, or trickled after a keep-alive response.

Timeouts here are a fraction of a second and every wait for the server to act is bounded by
BOUND, many times longer, which a passing run never reaches."""

from __future__ import annotations

import asyncio
import re
import ssl
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import TIMEOUT, until

BOUND = 20.0  # seconds; bounds a wait for a sub-second timeout to fire
HOST = "127.0.0.1"
REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def closed(reader: asyncio.StreamReader, bound: float = BOUND) -> bytes:
    """Everything the server sends before closing the connection (it must, within `bound`)."""
    try:
        return await asyncio.wait_for(reader.read(), bound)
    except ConnectionResetError:
        return b""


async def trickle(stream: Stream, data: bytes, step_s: float = 0.05) -> bytes | None:
    """Send `data` a byte every `step_s`; what the server sent once it closed the connection,
    or None if it was still open when every byte was sent."""
    reader, writer = stream
    for byte in data:
        try:  # (a single read: one cancelled while waiting consumes nothing)
            first = await asyncio.wait_for(reader.read(65536), step_s)
        except TimeoutError:
            writer.write(bytes([byte]))
            continue
        return first + await closed(reader)
    return None


async def exchange(stream: Stream) -> bytes:
    """One GET /health on a kept-alive connection; the whole response."""
    reader, writer = stream
    writer.write(REQUEST)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)[1])
    return head + await asyncio.wait_for(reader.readexactly(length), TIMEOUT)


async def pending_request(port: int) -> Stream:
    """A connection whose request's headers are complete and whose body never comes."""
    stream = await asyncio.open_connection(HOST, port)
    stream[1].write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    return stream


@pytest.fixture
async def http(start_server):
    """start(**overrides) -> (server, base_url) with the HTTP API on a free port."""

    async def start(**overrides):
        server, _ = await start_server(port=0, **overrides)
        return server, f"http://{HOST}:{server.http_port}"

    return start


async def test_idle_connections_past_the_cap_make_room_for_a_client_with_a_request(http) -> None:
    server, url = await http(http_max_connections=3, http_header_timeout_s=600)
    idle = []
    for count in range(1, 4):
        idle.append(await asyncio.open_connection(HOST, server.http_port))
        await until(lambda count=count: server.http.connections == count, "connection opened")
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        assert (await client.get("/health")).status_code == 200
    assert await closed(idle[0][0]) == b""  # the one idle longest, closed to make room
    await until(lambda: server.http.connections == 2, "the other two idle ones still open")
    for _, writer in idle:
        writer.close()


async def test_a_connection_past_the_cap_with_none_idle_gets_503_and_is_closed(http) -> None:
    server, url = await http(http_max_connections=2, http_header_timeout_s=600)
    busy = [await pending_request(server.http_port) for _ in range(2)]
    await until(lambda: server.http.requests.in_flight == 2, "both requests in the app")
    reader, _ = await asyncio.open_connection(HOST, server.http_port)
    answer = await closed(reader)
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert b"retry-after: 1" in answer and b"--http-max-connections" in answer
    busy[0][1].close()
    await until(lambda: server.http.connections < 2, "a connection freed")
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        assert (await client.get("/health")).status_code == 200
    busy[1][1].close()


async def test_requests_in_flight_past_the_cap_get_429_with_retry_after(http) -> None:
    server, url = await http(http_max_requests=1)
    _, busy = await pending_request(server.http_port)
    await until(lambda: server.http.requests.in_flight == 1, "the request in the app")
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        refused = await client.get("/health")
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"  # its body is not read, nor drained
        assert "--http-max-requests" in refused.json()["error"]["message"]
        busy.close()
        await until(lambda: server.http.requests.in_flight == 0, "the request gone")
        assert (await client.get("/health")).status_code == 200


async def test_a_completions_request_past_the_cap_is_counted(http) -> None:
    """Refused before the routes, still a generate request: counted as RESOURCE_EXHAUSTED
    (a /health refused likewise is not a generate call, and is not counted)."""
    server, url = await http(http_max_requests=1)
    _, busy = await pending_request(server.http_port)
    await until(lambda: server.http.requests.in_flight == 1, "the request in the app")
    labels = {"api": "http", "finish_reason": "none", "code": "RESOURCE_EXHAUSTED"}
    labels["model_name"] = server.metrics.model_name

    def counted() -> float:
        return server.metrics.registry.get_sample_value("kenspec_requests_total", labels) or 0

    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        assert (await client.get("/health")).status_code == 429
        assert counted() == 0
        body = {"model": "x", "prompt": "Hi", "max_tokens": 1}
        assert (await client.post("/v1/completions", json=body)).status_code == 429
        assert counted() == 1
    busy.close()


async def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(http) -> None:
    server, _ = await http(http_header_timeout_s=0.5)
    reader, _ = await asyncio.open_connection(HOST, server.http_port)
    assert await closed(reader) == b""  # nothing was asked: no 408 to misread


async def test_headers_trickled_a_byte_at_a_time_get_408_and_the_connection_closed(http) -> None:
    server, _ = await http(http_header_timeout_s=0.5)
    stream = await asyncio.open_connection(HOST, server.http_port)
    stream[1].write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    answer = await trickle(stream, b"X-Slow: " + b"a" * 400)  # 20 s, at a byte per 0.05 s
    assert answer is not None, "the connection was still open after 20 s of trickled headers"
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in answer and b"--http-header-timeout-s" in answer


async def test_a_kept_alive_connection_that_sends_nothing_closes_after_the_keepalive(http) -> None:
    server, _ = await http(http_keepalive_timeout_s=0.3, http_header_timeout_s=600)
    stream = await asyncio.open_connection(HOST, server.http_port)
    assert b"SERVING" in await exchange(stream)
    assert b"SERVING" in await exchange(stream)  # kept alive
    assert await closed(stream[0], bound=4.0) == b""  # (uvicorn's own default would be 5 s)


async def test_headers_trickled_after_a_response_get_408_after_the_header_timeout(http) -> None:
    server, _ = await http(http_keepalive_timeout_s=0.3, http_header_timeout_s=0.5)
    stream = await asyncio.open_connection(HOST, server.http_port)
    assert b"SERVING" in await exchange(stream)
    answer = await trickle(stream, b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 400)
    assert answer is not None, "the connection was still open after 20 s of trickled headers"
    assert answer.startswith(b"HTTP/1.1 408 ")


async def test_a_tls_handshake_that_never_comes_is_dropped_after_the_header_timeout(
    http, pki
) -> None:
    tls = {"tls_cert": str(pki["server_cert"]), "tls_key": str(pki["server_key"])}
    server, _ = await http(http_header_timeout_s=0.5, **tls)
    reader, _ = await asyncio.open_connection(HOST, server.http_port)
    await closed(reader)  # (asyncio's own handshake timeout is 60 s)
    async with httpx.AsyncClient(
        verify=ssl.create_default_context(cafile=pki["ca"]), timeout=TIMEOUT
    ) as client:
        response = await client.get(f"https://localhost:{server.http_port}/health")
        assert response.status_code == 200


async def test_a_request_running_past_the_header_timeout_is_not_cut(http, held_passes) -> None:
    server, url = await http(http_header_timeout_s=0.3, http_keepalive_timeout_s=0.3)
    body = {"model": Path(server.settings.model.model).name, "prompt": "The quick", "max_tokens": 3}
    body["temperature"] = 0  # greedy: no EOS in these three tokens (sampled, one could be)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        answer = asyncio.create_task(client.post("/v1/completions", json=body))
        await held_passes.arrival(1)
        await asyncio.sleep(1.0)  # held well past both timeouts
        held_passes.open()
        response = await answer
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3

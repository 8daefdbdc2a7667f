"""The HTTP API against hostile clients: bodies that used to get a 500, bodies that are not
JSON, requests from other hosts and origins (a web page in a local browser), bodies trickled
or abandoned mid-way; each answered with a 4xx (or nothing, to a client that has left), each
counted, nothing logged as an error, and the server still serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import time
from pathlib import Path

import httpx
import pytest
import structlog

from kenspec.server.openai_api.guards import HostPolicy
from kenspec.server.settings import parse_settings

TIMEOUT = 30.0  # seconds; bounds waits that a passing run never reaches
JSON = {"content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
async def http_server(start_server):
    """start(**overrides) -> (server, base_url) with the HTTP API on a free port."""

    async def start(**overrides):
        server, _ = await start_server(port=0, **overrides)
        return server, f"http://127.0.0.1:{server.http_port}"

    return start


@pytest.fixture
def logged(caplog):
    """The log so far: structlog's events (dicts) and the standard library's records (uvicorn
    logs "Exception in ASGI application" there); `errors()` those at error level or above."""

    class Log:
        def errors(self) -> list[object]:
            ours = [e for e in events if e["log_level"] in ("error", "critical")]
            theirs = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            return ours + theirs

        def named(self, event: str) -> list[dict]:
            return [e for e in events if e["event"] == event]

    with structlog.testing.capture_logs() as events:
        yield Log()


def model(server) -> str:
    return Path(server.settings.model.model).name


def counted(server, code: str) -> float:
    labels = {"api": "http", "finish_reason": "none", "code": code}
    labels["model_name"] = server.metrics.model_name
    return server.metrics.registry.get_sample_value("kenspec_requests_total", labels) or 0.0


async def still_serves(client: httpx.AsyncClient, server) -> None:
    body = {"model": model(server), "prompt": "Hi", "max_tokens": 2}
    answer = await client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert (await client.get("/health")).status_code == 200


def raw(template: str, server) -> bytes:
    """A body written by hand (what json.dumps would not write), MODEL replaced."""
    return template.replace("MODEL", model(server)).encode()


# (route, body template, the param the 400 names: None for the body as a whole)
HOSTILE = {
    "deep nesting": ("completions", "[" * 100_000 + "]" * 100_000, None),
    "deep nesting in a field": (
        "chat",
        '{"model": "MODEL", "messages": ' + "[" * 50 + "]" * 50 + "}",
        "messages",
    ),
    "an integer of 5000 digits": (
        "completions",
        '{"model": "MODEL", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}",
        None,
    ),
    "temperature 1e400 as an integer": (
        "completions",
        '{"model": "MODEL", "prompt": "x", "temperature": 1' + "0" * 400 + "}",
        "temperature",
    ),
    "a role that is a list": (
        "chat",
        '{"model": "MODEL", "messages": [{"role": ["user"], "content": "x"}]}',
        "messages[0].role",
    ),
    "a lone surrogate in the prompt": (
        "completions",
        '{"model": "MODEL", "prompt": "a\\ud800b"}',
        "prompt",
    ),
    "a lone surrogate in chat content": (
        "chat",
        '{"model": "MODEL", "messages": [{"role": "user", "content": "\\udfff"}]}',
        "messages[0].content",
    ),
    "a lone surrogate in a content part": (
        "chat",
        '{"model": "MODEL", "messages": [{"role": "user", '
        '"content": [{"type": "text", "text": "x\\ud800"}]}]}',
        "messages[0].content[0].text",
    ),
    "a lone surrogate in user": (
        "completions",
        '{"model": "MODEL", "prompt": "x", "user": "\\ud800"}',
        "user",
    ),
    "a lone surrogate in a key": ("completions", '{"model": "MODEL", "\\ud800": 1}', "\\ud800"),
    "NaN": ("completions", '{"model": "MODEL", "prompt": "x", "temperature": NaN}', None),
    "true as max_tokens": (
        "completions",
        '{"model": "MODEL", "prompt": "x", "max_tokens": true}',
        "max_tokens",
    ),
    "true as n": (
        "chat",
        '{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "n": true}',
        "n",
    ),
    "0 as logprobs": ("chat", '{"model": "MODEL", "messages": [], "logprobs": 0}', "logprobs"),
    "a float as max_tokens": (
        "completions",
        '{"model": "MODEL", "prompt": "x", "max_tokens": 2.0}',
        "max_tokens",
    ),
    "false as stop": ("completions", '{"model": "MODEL", "prompt": "x", "stop": false}', "stop"),
    "a newline in user": (
        "completions",
        '{"model": "MODEL", "prompt": "x", "user": "a\\nb"}',
        "user",
    ),
    "a model id of 300 characters": (
        "completions",
        '{"model": "' + "m" * 300 + '", "prompt": "x"}',
        "model",
    ),
    "a message with tool calls": (  # (an extra content part field is ignored and listed)
        "chat",
        '{"model": "MODEL", "messages": [{"role": "assistant", "content": "x", '
        '"tool_calls": [{"id": "1"}]}]}',
        "messages[0].tool_calls[0]",
    ),
    "not UTF-8": ("completions", '{"model": "MODEL", "prompt": "\xff"}', None),
}


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
async def test_hostile_bodies_get_a_400_naming_the_field(http_server, logged, case) -> None:
    server, url = await http_server()
    route, template, param = HOSTILE[case]
    data = raw(template, server)
    if case == "not UTF-8":
        data = data.replace("\xff".encode(), b"\xff")
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        refused = await client.post(
            f"/v1/{route.replace('chat', 'chat/completions')}", content=data, headers=JSON
        )
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert "Traceback" not in error["message"]
        await still_serves(client, server)
    assert counted(server, "INVALID_ARGUMENT") == 1
    assert logged.errors() == []


async def test_nul_is_text_in_a_prompt(http_server, logged) -> None:
    """NUL and control characters are text to the tokenizer: served, not refused."""
    server, url = await http_server()
    body = {"model": model(server), "prompt": "a\x00b\x1b[2J", "max_tokens": 2, "stop": "\x00"}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        answer = await client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert logged.errors() == []


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        "application/jsonl",
    ],
)
async def test_a_body_not_declared_json_is_415(http_server, logged, content_type) -> None:
    server, url = await http_server()
    body = json.dumps({"model": model(server), "prompt": "Hi", "max_tokens": 2})
    headers = {} if content_type is None else {"content-type": content_type}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        refused = await client.post("/v1/completions", content=body, headers=headers)
        assert refused.status_code == 415, refused.text
        error = refused.json()["error"]
        assert "Content-Type: application/json" in error["message"]
        assert error["param"] == "content-type"
        await still_serves(client, server)
    assert counted(server, "INVALID_ARGUMENT") == 1
    assert logged.errors() == []


@pytest.mark.parametrize(
    "content_type",
    ["application/json; charset=utf-8", "Application/JSON", 'application/json;charset="UTF-8"'],
)
async def test_json_with_parameters_is_served(http_server, content_type) -> None:
    server, url = await http_server()
    body = json.dumps({"model": model(server), "prompt": "Hi", "max_tokens": 2})
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        answer = await client.post(
            "/v1/completions", content=body, headers={"content-type": content_type}
        )
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": b"Bearer \xff\xfe" + b"x" * 4000},
        {"authorization": b"\x01\x02"},
        {"x-request-id": b"\xc3\xa9t\xc3\xa9"},
        {"x-request-id": b"x" * 4000},
        {"host": b"a b"},
        {"host": b"[::1"},
        {"host": b"localhost:99999999"},
        {"host": b"\xff"},
        {"origin": b"http://[::1"},
        {"content-type": b"application/json; charset"},
        {"content-type": b"\xff/\xfe"},
        {"traceparent": b"\xff" * 100},
    ],
)
async def test_odd_headers_get_a_4xx_or_are_served(http_server, logged, headers) -> None:
    server, url = await http_server()
    body = json.dumps({"model": model(server), "prompt": "Hi", "max_tokens": 2})
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        answer = await client.post("/v1/completions", content=body, headers={**JSON, **headers})
        assert answer.status_code < 500, answer.text
        if answer.status_code != 200:
            assert answer.json()["error"]["message"]
        await still_serves(client, server)
    assert logged.errors() == []


async def test_hosts_and_origins_without_tokens(http_server, logged) -> None:
    server, url = await http_server()
    body = {"model": model(server), "prompt": "Hi", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:

        async def status(path: str = "/v1/completions", **headers: str) -> int:
            if path == "/v1/completions":
                return (await client.post(path, json=body, headers=headers)).status_code
            return (await client.get(path, headers=headers)).status_code

        for host in ("localhost", "LocalHost:8000", "127.0.0.1", "127.9.9.9:1", "[::1]:80"):
            assert await status(host=host) == 200, host
        rebinding = await client.post("/v1/completions", json=body, headers={"host": "evil.test"})
        assert rebinding.status_code == 421
        assert rebinding.json()["error"]["code"] == "host_not_allowed"
        assert "--allowed-hosts" in rebinding.json()["error"]["message"]
        assert await status("/v1/models", host="evil.test") == 421
        assert await status("/health", host="evil.test") == 200  # probes use the pod's address
        for origin in ("http://localhost:3000", "https://127.0.0.1", "http://[::1]:8080"):
            assert await status(origin=origin) == 200, origin
        for origin in ("https://evil.test", "null", "http://localhost.evil.test", "garbage"):
            assert await status(origin=origin) == 403, origin
    assert counted(server, "PERMISSION_DENIED") == 5  # /v1/models is not a generate call
    assert logged.errors() == []


async def test_allowed_hosts_and_tokens(http_server, tmp_path) -> None:
    server, url = await http_server(allowed_hosts="api.example, [fe80::1]")
    body = {"model": model(server), "prompt": "Hi", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        for host, expected in (("api.example:8000", 200), ("[fe80::1]", 200), ("b.example", 421)):
            answer = await client.post("/v1/completions", json=body, headers={"host": host})
            assert answer.status_code == expected, host
        origin = {"origin": "https://api.example"}
        assert (await client.post("/v1/completions", json=body, headers=origin)).status_code == 200
    server, url = await http_server(allowed_hosts="*")
    body["model"] = model(server)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        headers = {"host": "any.test", "origin": "https://any.test"}
        assert (await client.post("/v1/completions", json=body, headers=headers)).status_code == 200
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    server, url = await http_server(auth_tokens_file=str(tokens))
    body["model"] = model(server)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        headers = {"host": "evil.test", "origin": "https://evil.test"}
        assert (await client.post("/v1/completions", json=body, headers=headers)).status_code == 401
        headers["authorization"] = "Bearer secret"  # the token is the check: no names
        assert (await client.post("/v1/completions", json=body, headers=headers)).status_code == 200


def test_host_policy_takes_a_concrete_bind_address_only() -> None:
    assert HostPolicy.of("", "10.1.2.3").allows("10.1.2.3")
    assert HostPolicy.of("", "my-box.lan").allows("my-box.lan")
    for wildcard in ("0.0.0.0", "::", ""):
        policy = HostPolicy.of("", wildcard)
        assert policy.allows("127.0.0.1") and policy.allows("::1") and policy.allows("localhost")
        assert not policy.allows("10.1.2.3") and not policy.allows("0.0.0.0")
    assert HostPolicy.of("Api.Example.", "::").allows("api.example")


@pytest.mark.parametrize("value", ["a b", "host:8000", "http://x", "a/b"])
def test_allowed_hosts_flag_refuses_what_is_not_a_name(value, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--allowed-hosts", value])
    assert "is not a host name or address" in capsys.readouterr().err
    names = "api.example, [::1],10.0.0.7,*"
    assert parse_settings(["--allowed-hosts", names]).security.allowed_hosts == names


def test_body_timeout_flag_must_be_positive(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--http-body-timeout-s", "0"])
    assert parse_settings(["--http-body-timeout-s", "2.5"]).limits.http_body_timeout_s == 2.5


def _send_slowly(port: int, head: bytes, trickle: bool) -> bytes:
    """Send `head`, then a byte every 0.1 s (when `trickle`) until the server answers, for at
    most 10 s; then read the answer until the server closes. A blocking socket, since the
    server closes on trickled bytes it has not read, which the kernel answers with a reset:
    recv still returns what came before it, where asyncio's streams raise the reset instead."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(head)
        for _ in range(100):
            if select.select([sock], [], [], 0.1)[0]:
                break
            if trickle:
                with contextlib.suppress(OSError):
                    sock.sendall(b" ")
        with contextlib.suppress(ConnectionResetError):  # a reset after the answer: closed
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def _request_head(length: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


@pytest.mark.parametrize("trickle", [True, False])
async def test_a_body_slower_than_the_timeout_gets_408_and_a_close(
    http_server, logged, trickle
) -> None:
    server, url = await http_server(http_body_timeout_s=0.5)
    answer = await asyncio.to_thread(_send_slowly, server.http_port, _request_head(1000), trickle)
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    assert status_line.split()[1] == "408", answer
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert headers.get("connection") == "close"  # and it was: the read above reached its end
    assert counted(server, "DEADLINE_EXCEEDED") == 1
    assert logged.errors() == []
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        await still_serves(client, server)


async def test_a_client_that_leaves_mid_body_is_counted_and_logged_once(
    http_server, logged
) -> None:
    server, url = await http_server()
    _, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    writer.write(_request_head(1000) + b'{"model": "x", "prompt": "')
    await writer.drain()
    writer.close()  # half the body, then gone
    await writer.wait_closed()
    for _ in range(int(TIMEOUT / 0.05)):  # the route notices the disconnect on its next read
        if counted(server, "CANCELLED"):
            break
        await asyncio.sleep(0.05)
    assert counted(server, "CANCELLED") == 1
    gone = logged.named("client_gone")
    assert len(gone) == 1 and gone[0]["log_level"] == "info" and "exc_info" not in gone[0]
    assert logged.errors() == []
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        await still_serves(client, server)


async def test_every_generate_request_is_counted_whatever_stage_it_ends_at(
    http_server, tmp_path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    server, url = await http_server(auth_tokens_file=str(tokens), max_message_bytes=4096)
    body = {"model": model(server), "prompt": "Hi", "max_tokens": 2}
    auth = {"authorization": "Bearer secret"}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        assert (await client.post("/v1/completions", json=body)).status_code == 401
        bad_id = {**auth, "x-request-id": "a\tb"}
        assert (await client.post("/v1/completions", json=body, headers=bad_id)).status_code == 400
        text = {**auth, "content-type": "text/plain"}
        sent = await client.post("/v1/completions", content=json.dumps(body), headers=text)
        assert sent.status_code == 415
        huge = {**body, "prompt": "x" * 5000}
        assert (await client.post("/v1/completions", json=huge, headers=auth)).status_code == 413
        unknown = {**body, "model": "gpt-4o"}
        assert (await client.post("/v1/completions", json=unknown, headers=auth)).status_code == 404
        assert (await client.post("/v1/completions", json=body, headers=auth)).status_code == 200
        assert (await client.get("/v1/models", headers=auth)).status_code == 200
        assert (await client.get("/health")).status_code == 200
        server.serving.draining = True
        assert (await client.post("/v1/completions", json=body, headers=auth)).status_code == 503
    expected = {
        "UNAUTHENTICATED": 1,
        "INVALID_ARGUMENT": 2,  # the request id and the Content-Type
        "RESOURCE_EXHAUSTED": 1,
        "NOT_FOUND": 1,
        "UNAVAILABLE": 1,
    }
    for code, count in expected.items():
        assert counted(server, code) == count, code
    total = sum(
        sample.value
        for family in server.metrics.registry.collect()
        if family.name == "kenspec_requests"
        for sample in family.samples
        if sample.name == "kenspec_requests_total"
    )
    assert total == 7  # the models list and health are not generate calls: not counted


OVERSIZED = 1_200_000  # bytes: over the default --max-message-bytes (1 MiB)


async def _oversized_chunks(server):
    """An oversized completions body, sent chunked (no Content-Length: read up to the limit)."""
    prefix = f'{{"model": "{model(server)}", "prompt": "'.encode()
    yield prefix
    for _ in range(OVERSIZED // 65536):
        yield b"x" * 65536
    yield b'"}'


async def post_oversized(server, url: str, *, declared: bool = False) -> httpx.Response | str:
    """An oversized completions request on a new connection: the answer, or the transport
    error that came instead (a reset: what a close with the body unread causes)."""
    whole = b'{"prompt": "' + b"x" * OVERSIZED + b'"}'  # (sent with its Content-Length)
    content = whole if declared else _oversized_chunks(server)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        try:
            return await client.post("/v1/completions", content=content, headers=JSON)
        except httpx.TransportError as error:
            return repr(error)


def status(answer: httpx.Response | str) -> int | str:
    return answer.status_code if isinstance(answer, httpx.Response) else answer


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_every_oversized_body_reads_its_413(http_server, logged, declared) -> None:
    """The server closes after a 413 with most of the body unread: it reads and discards the
    rest first (a lingering close), so the client reads the 413 instead of a reset."""
    server, url = await http_server()
    assert server.settings.limits.max_message_bytes < OVERSIZED
    answers = [await post_oversized(server, url, declared=declared) for _ in range(30)]
    assert [status(answer) for answer in answers] == [413] * 30
    for answer in answers:
        assert isinstance(answer, httpx.Response)
        assert answer.json()["error"]["message"].startswith("the body is")
        assert answer.headers["connection"] == "close"
    assert logged.errors() == []
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        await still_serves(client, server)


async def test_a_429_before_a_big_body_is_read_too(http_server, logged) -> None:
    """RequestCap's 429 comes before the body: the lingering close lets the client read it."""
    server, url = await http_server(http_max_requests=1)
    _, busy = await asyncio.open_connection("127.0.0.1", server.http_port)
    busy.write(_request_head(100) + b"{")  # in the app, its body never finished
    for _ in range(int(TIMEOUT / 0.01)):
        if server.http.requests.in_flight == 1:
            break
        await asyncio.sleep(0.01)
    answers = [await post_oversized(server, url) for _ in range(10)]
    assert [status(answer) for answer in answers] == [429] * 10
    busy.close()
    assert logged.errors() == []


def _keep_sending(port: int, bound_s: float) -> tuple[bytes, float | None]:
    """Send the head of a 100 MB body, then keep sending until the server closes the
    connection (a send fails). What the server answered, and how long after it answered the
    connection closed (None: still open after `bound_s`)."""
    answer, answered = b"", None
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(_request_head(100_000_000))
        sock.settimeout(0.02)
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"x" * 65536)
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset: the server closed
                return answer, time.monotonic() - answered if answered else None
            if chunk and answered is None:
                answered = time.monotonic()
            answer += chunk
    return answer, None


@pytest.mark.parametrize("bound", ["time", "bytes"])
async def test_a_lingering_close_is_bounded(http_server, monkeypatch, bound) -> None:
    """A client that goes on sending after its 413 cannot hold the connection: it is closed
    after LINGER_S, or LINGER_BYTES thrown away, whichever comes first."""
    from kenspec.server.openai_api import connections

    if bound == "time":  # (and no byte bound)
        monkeypatch.setattr(connections, "LINGER_S", 0.5)
        monkeypatch.setattr(connections, "LINGER_BYTES", 1 << 40)
    else:  # (and no time bound within the test's)
        monkeypatch.setattr(connections, "LINGER_S", 600.0)
        monkeypatch.setattr(connections, "LINGER_BYTES", 1 << 20)
    server, _ = await http_server()
    answer, closed_after = await asyncio.to_thread(_keep_sending, server.http_port, 30.0)
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert closed_after is not None, "still open after 30 s of sending"
    assert closed_after < 10.0

"""The drain (KenspecServer.stop, what SIGTERM runs): both ports keep answering while in-flight
streams finish, new calls get 503 / UNAVAILABLE saying why, both health checks report
NOT_SERVING, and the server stops as soon as the last stream ends; streams still running when
the grace period runs out end with an error the client can read, not a cut connection.

Streams are held at the pass gate (conftest's held_passes), so no verdict waits on the
machine's speed: a stream is in flight exactly until the test lets its passes through."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import grpc
import httpx
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kenspec.api import generator_pb2 as pb
from tests.server.conftest import TIMEOUT, PassGate, until

JSON = {"content-type": "application/json"}
LONG_GRACE_S = 120.0  # a grace the drain must not wait out: it ends with the last stream


@pytest.fixture
def logged(caplog):
    """Log lines at error level or above, structlog's and the standard library's (uvicorn
    logs "Exception in ASGI application" there)."""

    class Log:
        def errors(self) -> list[object]:
            ours = [e for e in events if e["log_level"] in ("error", "critical")]
            theirs = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            return ours + theirs

    with structlog.testing.capture_logs() as events:
        yield Log()


def completion(server, max_tokens: int) -> dict:
    return {
        "model": Path(server.settings.model.model).name,
        "prompt": "The quick brown fox",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "speculation": "off",
    }


async def big_body():  # type: ignore[no-untyped-def]
    """1.2 MB of a completions body, chunked: the server refuses it before reading it."""
    yield b'{"prompt": "'
    for _ in range(20):
        yield b"x" * 60_000
    yield b'"}'


def grpc_request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="Hello world",
        stopping=pb.StoppingCriteria(max_new_tokens=max_tokens, ignore_eos=True),
        speculation=pb.SpeculationParameters(mode=pb.SPECULATION_MODE_OFF),
    )


class SseStream:
    """A streamed completion read event by event (httpx raises on a cut chunked body)."""

    def __init__(self, client: httpx.AsyncClient, body: dict) -> None:
        self._context = client.stream("POST", "/v1/completions", json=body)
        self.response: httpx.Response | None = None
        self._lines = None

    async def open(self) -> SseStream:
        self.response = await self._context.__aenter__()
        assert self.response.status_code == 200, await self.response.aread()
        self._lines = self.response.aiter_lines()
        return self

    async def event(self) -> str | None:
        """The next event's data (None at the end of the body)."""
        async for line in self._lines:  # type: ignore[union-attr]
            if line.startswith("data: "):
                return line.removeprefix("data: ")
        return None

    async def rest(self) -> list[str]:
        events = []
        while (data := await asyncio.wait_for(self.event(), TIMEOUT)) is not None:
            events.append(data)
        return events

    async def close(self) -> None:
        await self._context.__aexit__(None, None, None)


async def held_in_flight(server, stub, client, gate: PassGate) -> tuple:
    """A gRPC stream and a streamed HTTP completion, each past its first round, both held at
    the gate in the same pass (neither can finish until the test opens it)."""
    call = stub.Generate(grpc_request(40), timeout=TIMEOUT)
    gate.allow(1)
    first = await asyncio.wait_for(call.read(), TIMEOUT)
    assert first.token_ids
    opening = asyncio.create_task(SseStream(client, completion(server, 40)).open())
    count = 2
    while len((await gate.arrival(count)).rows) < 2:  # until the HTTP request joins the batch
        gate.allow(1)
        count += 1
    gate.allow(1)  # its prefill: its first round
    stream = await asyncio.wait_for(opening, TIMEOUT)
    assert json.loads(await asyncio.wait_for(stream.event(), TIMEOUT))["choices"]
    await gate.arrival(count + 1)  # both held in the next pass
    return call, stream


async def rest_of(call) -> list[pb.GenerateResponse]:  # type: ignore[no-untyped-def]
    """The responses of a call after those read with read() (its error raised)."""
    responses = []
    while (response := await asyncio.wait_for(call.read(), TIMEOUT)) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def grpc_health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        return response.status


async def test_a_drain_answers_new_calls_until_the_streams_in_flight_end(
    start_server, held_passes, logged
) -> None:
    server, stub = await start_server(port=0)
    url = f"http://127.0.0.1:{server.http_port}"
    async with (
        httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as streaming,
        httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client,
    ):
        call, stream = await held_in_flight(server, stub, streaming, held_passes)
        started = time.monotonic()
        stopping = asyncio.create_task(server.stop(LONG_GRACE_S))
        await until(lambda: server.serving.draining, "the drain started")

        # HTTP: still listening; new calls get 503 saying why, and health is NOT_SERVING.
        refused = await client.post("/v1/completions", json={**completion(server, 2)})
        assert refused.status_code == 503, refused.text
        assert "draining" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        unread = await client.post("/v1/completions", content=big_body(), headers=JSON)
        assert unread.status_code == 503  # read, not reset: its body was drained, not parsed
        health = await client.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "NOT_SERVING"})

        # gRPC: health answers NOT_SERVING; a new Generate gets UNAVAILABLE saying why.
        assert await grpc_health(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await asyncio.wait_for(stub.Generate(grpc_request(2)).read(), TIMEOUT)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in error.value.details()

        assert not stopping.done()  # the streams in flight hold the drain open
        held_passes.open()
        responses = await rest_of(call)
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.token_ids) for r in responses) == 39  # all 40, the first read above
        events = await stream.rest()
        await stream.close()
        assert events[-1] == "[DONE]" and "error" not in "".join(events)
        finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finishes[-1] == "length"
        await asyncio.wait_for(stopping, TIMEOUT)  # as soon as they ended: not the grace
    assert time.monotonic() - started < LONG_GRACE_S / 2
    assert logged.errors() == []


async def test_streams_cut_at_the_end_of_the_grace_end_with_an_error(
    start_server, held_passes, logged
) -> None:
    server, stub = await start_server(port=0)
    url = f"http://127.0.0.1:{server.http_port}"
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        call, stream = await held_in_flight(server, stub, client, held_passes)
        stopping = asyncio.create_task(server.stop(0.5))
        # The HTTP stream: an error event, then a complete chunked body (httpx raises on a cut
        # one); the error in the shape in-stream errors have.
        events = await stream.rest()
        await stream.close()
        error = json.loads(events[-1])["error"]
        assert error["type"] == "server_error"
        assert "shut down" in error["message"] and "--grace-period-s" in error["message"]
        # The gRPC stream: UNAVAILABLE, saying so.
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await rest_of(call)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shut down" in cut.value.details()
        held_passes.open()  # the engine thread finishes its pass: the server can stop
        await asyncio.wait_for(stopping, TIMEOUT)
    assert logged.errors() == []

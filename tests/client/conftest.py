"""A fake Generator servicer on ephemeral ports, for client tests (no model, no network).

The fake streams three canned rounds that echo the request, and misbehaves on magic prompts:
"__invalid__" aborts with INVALID_ARGUMENT, "__slow__" stalls, "__endless__" never finishes,
"__no_finish__" ends without a finish reason. Every request and its metadata are recorded.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc


class FakeGenerator(pb_grpc.GeneratorServicer):
    INVALID_MESSAGE = "max_new_tokens=100000 exceeds the server limit of 4096"

    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.requests: list[pb.GenerateRequest | pb.TokenizeRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = threading.Event()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._record(request, context)
        if request.prompt == "__invalid__":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.INVALID_MESSAGE)
        if request.prompt == "__slow__":
            await asyncio.sleep(30)
        try:
            if request.prompt == "__endless__":
                while True:
                    yield pb.GenerateResponse(text=".", token_ids=[0])
                    await asyncio.sleep(0.01)
            for response in canned_rounds(request):
                if request.prompt == "__no_finish__" and response.finish_reason:
                    return
                yield response
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        self._record(request, context)
        text = request.prompt or "".join(m.content for m in request.messages.messages)
        tokens = list(text) if request.return_tokens else []
        return pb.TokenizeResponse(
            token_ids=[ord(c) for c in text], tokens=tokens, token_count=len(text)
        )

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        self.metadata.append(dict(context.invocation_metadata() or ()))
        return pb.ModelInfo(model=self.name, draft="fake.arpa", draft_order=3, version="test")

    def _record(
        self, request: pb.GenerateRequest | pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> None:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata() or ()))


def canned_rounds(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """Speculative, autoregressive, speculative: 7 tokens, "Hello <echo>", 2 mode switches."""
    request_id = request.request_id or "fake-1"
    echo = request.prompt or request.messages.messages[-1].content
    seed = request.sampling.seed if request.sampling.HasField("seed") else 42
    spec, plain = pb.ROUND_MODE_SPECULATIVE, pb.ROUND_MODE_AUTOREGRESSIVE
    closed = pb.BREAKER_STATE_CLOSED
    return [
        pb.GenerateResponse(
            request_id=request_id,
            token_ids=[1, 2, 3, 4],
            text="Hel",
            round=pb.RoundInfo(index=0, drafted=4, accepted=3, mode=spec, breaker_state=closed),
        ),
        pb.GenerateResponse(
            request_id=request_id,
            token_ids=[5],
            text="lo",
            round=pb.RoundInfo(index=1, mode=plain, breaker_state=pb.BREAKER_STATE_OPEN),
        ),
        pb.GenerateResponse(
            request_id=request_id,
            token_ids=[6, 7],
            text=f" {echo}",
            round=pb.RoundInfo(index=2, drafted=2, accepted=1, mode=spec, breaker_state=closed),
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(
                prompt_tokens=len(echo),
                completion_tokens=7,
                drafted_tokens=6,
                accepted_tokens=4,
                rounds=3,
                seed=seed,
            ),
        ),
    ]


@dataclass
class FakeServer:
    address: str
    servicer: FakeGenerator


async def start_fake(
    servicer: FakeGenerator, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_GeneratorServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, f"127.0.0.1:{port}"


StartFake = Callable[..., Awaitable[FakeServer]]
StartThreadedFake = Callable[..., FakeServer]


@pytest.fixture
async def start_fake_server() -> AsyncIterator[StartFake]:
    """``await start_fake_server(name="fake", credentials=None)``: a fake in the test's loop."""
    servers: list[grpc.aio.Server] = []

    async def start(
        name: str = "fake", credentials: grpc.ServerCredentials | None = None
    ) -> FakeServer:
        servicer = FakeGenerator(name)
        server, address = await start_fake(servicer, credentials)
        servers.append(server)
        return FakeServer(address, servicer)

    yield start
    for server in servers:
        await server.stop(grace=None)


@pytest.fixture
async def fake(start_fake_server: StartFake) -> FakeServer:
    """A fake server in the test's own event loop, for AsyncClient tests."""
    return await start_fake_server()


class ThreadedFake:
    """A fake server on its own event loop in a background thread, for blocking clients."""

    def __init__(self, servicer: FakeGenerator) -> None:
        self.servicer = servicer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None

    def start(self, credentials: grpc.ServerCredentials | None = None) -> str:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(
            start_fake(self.servicer, credentials), self._loop
        )
        self._server, address = started.result(timeout=10)
        return address

    def stop(self) -> None:
        if self._server is not None:
            stopped = asyncio.run_coroutine_threadsafe(self._server.stop(grace=None), self._loop)
            stopped.result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def start_threaded_fake() -> Iterator[StartThreadedFake]:
    """``start_threaded_fake(name="fake", credentials=None)``: a fake for blocking code."""
    runners: list[ThreadedFake] = []

    def start(name: str = "fake", credentials: grpc.ServerCredentials | None = None) -> FakeServer:
        runner = ThreadedFake(FakeGenerator(name))
        runners.append(runner)
        return FakeServer(runner.start(credentials), runner.servicer)

    yield start
    for runner in runners:
        runner.stop()


@pytest.fixture
def threaded_fake(start_threaded_fake: StartThreadedFake) -> FakeServer:
    """A fake server reachable from synchronous code (Client, the CLI)."""
    return start_threaded_fake()


@pytest.fixture
def dead_address() -> str:
    """A local port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def _no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    # The developer's own KENSPEC_* settings must not leak into client tests.
    monkeypatch.delenv("KENSPEC_TOKEN", raising=False)
    monkeypatch.delenv("KENSPEC_ADDRESS", raising=False)

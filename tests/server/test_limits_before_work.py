"""Limits before work: an input over the character limit is refused before any tokenizer work
(a spy on the target's encode functions says none was done), on both APIs and Tokenize; the
derived limit never refuses text that fits the token limit; Tokenize refuses what Generate
would; and many huge inputs at once leave the health checks answering as at rest.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.engine.target import TargetModel
from kenspec.server.generate_params import prompt_char_limit
from kenspec.server.lifecycle import KenspecServer
from kenspec.server.runtime import load_runtime
from kenspec.server.serving import LARGE_INPUT_CHARS, Serving

TIMEOUT = 60.0  # seconds; bounds waits that a passing run never reaches
ENCODERS = ("encode_prompt", "encode_chat", "chat_text", "encode_chat_text")


@pytest.fixture
def encoded(monkeypatch) -> list[str]:
    """The target's encode functions called so far, by name (each still does its work)."""
    calls: list[str] = []
    for name in ENCODERS:
        original = getattr(TargetModel, name)

        def spy(target, *arguments, _name=name, _original=original):  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _original(target, *arguments)

        monkeypatch.setattr(TargetModel, name, spy)
    return calls


def chat(*contents: str) -> pb.Messages:
    return pb.Messages(messages=[pb.ChatMessage(role="user", content=c) for c in contents])


async def refusal(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        response = await call
        if not isinstance(response, pb.TokenizeResponse):
            raise AssertionError(f"answered {response}")
    return raised.value


async def generate(stub, **request) -> None:  # type: ignore[no-untyped-def]
    async for _ in stub.Generate(pb.GenerateRequest(**request), timeout=TIMEOUT):
        pass


@pytest.mark.parametrize("method", ["Generate", "Tokenize"])
@pytest.mark.parametrize("field", ["prompt", "messages"])
async def test_an_input_over_the_character_limit_is_refused_before_tokenizing(
    start_server, runtime, encoded, method, field
) -> None:
    _, stub = await start_server()
    limit = runtime.limits.max_prompt_chars
    # A chat's contents are summed: two messages, each under the limit, over it together.
    text = "a" * (limit + 1)
    inputs = {"prompt": text} if field == "prompt" else {"messages": chat(text[::2], text[1::2])}
    call = (
        generate(stub, **inputs)
        if method == "Generate"
        else stub.Tokenize(pb.TokenizeRequest(**inputs), timeout=TIMEOUT)
    )
    error = await refusal(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}: {limit + 1} characters exceed")
    assert str(limit) in error.details()
    assert encoded == []


async def test_a_chat_over_the_limit_with_its_template_is_refused_before_tokenizing(
    start_server, runtime, encoded
) -> None:
    """Contents within the limit, the rendered chat (the template's text added) beyond it."""
    _, stub = await start_server()
    limit = runtime.limits.max_prompt_chars
    error = await refusal(stub.Tokenize(pb.TokenizeRequest(messages=chat("a" * limit))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("messages: ")
    assert "characters exceed" in error.details()
    assert encoded == ["chat_text"]  # rendered, never tokenized


async def test_http_refuses_a_prompt_over_the_character_limit_before_tokenizing(
    start_server, runtime, encoded
) -> None:
    server, _ = await start_server(port=0)
    limit = runtime.limits.max_prompt_chars
    body = {"model": Path(server.settings.model.model).name, "prompt": "a" * (limit + 1)}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        response = await client.post(
            f"http://127.0.0.1:{server.http_port}/v1/completions", json=body
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert f"{limit + 1} characters exceed" in response.json()["error"]["message"]
    assert encoded == []


async def test_an_input_within_the_character_limit_is_tokenized(
    start_server, runtime, encoded
) -> None:
    """At the limit the character check lets it through; the token count decides."""
    _, stub = await start_server()
    limit = runtime.limits.max_prompt_chars
    error = await refusal(stub.Tokenize(pb.TokenizeRequest(prompt="a" * limit)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens exceed the server limit of 512" in error.details()
    assert encoded == ["encode_prompt"]


async def test_tokenize_refuses_what_generate_would_and_counts_what_fits(start_server) -> None:
    _, stub = await start_server()
    long = "word " * 600  # over the tiny model's 512-token context, within its character limit
    error = await refusal(stub.Tokenize(pb.TokenizeRequest(messages=chat(long))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("messages: ")
    assert "tokens exceed the server limit of 512" in error.details()
    fits = await stub.Tokenize(pb.TokenizeRequest(prompt="word " * 50), timeout=TIMEOUT)
    assert 0 < fits.token_count <= 512 and len(fits.token_ids) == fits.token_count


def test_the_flags_set_the_limits(base_settings) -> None:
    settings_ = base_settings.replace(max_prompt_chars=100, tokenize_concurrency=3)
    limits = load_runtime(settings_).limits
    assert (limits.max_prompt_chars, limits.tokenize_concurrency) == (100, 3)


def test_the_derived_limit_is_the_token_limit_times_the_longest_token(tiny_target) -> None:
    vocab = tiny_target.tokenizer.get_vocab()
    longest = max(len(token) for token in vocab)
    assert prompt_char_limit(0, 512, vocab) == 512 * longest
    assert prompt_char_limit(1000, 512, vocab) == 1000


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=300))
def test_no_text_has_more_characters_than_its_tokens_allow(tiny_target, text) -> None:
    """The bound the derived limit rests on: a text of n tokens has at most n times the
    longest token's characters, so the character check never refuses text that fits."""
    longest = max(map(len, tiny_target.tokenizer.get_vocab()))
    for ids in (tiny_target.encode_prompt(text), tiny_target.encode_chat_text(text)):
        assert len(text) <= len(ids) * longest


async def health_seconds(checks: dict[str, Callable], times: int) -> dict[str, list[float]]:
    """How long each check took, `times` rounds of one after another."""
    seconds: dict[str, list[float]] = {name: [] for name in checks}
    for _ in range(times):
        for name, check in checks.items():
            started = time.perf_counter()
            await check()
            seconds[name].append(time.perf_counter() - started)
    return seconds


@pytest.fixture
async def start_with_limits(base_settings, runtime, serve_loaded) -> AsyncIterator[Callable]:
    """start(**limits) -> a server (with the HTTP API) over the runtime with those limits."""
    servers: list[KenspecServer] = []

    async def start(**limits: int) -> KenspecServer:
        limited = replace(runtime, limits=replace(runtime.limits, **limits))
        server = KenspecServer(base_settings.replace(port=0), serve_loaded(limited))
        servers.append(server)
        await server.start()
        await server.load()
        return server

    yield start
    for server in servers:
        await server.stop(0)


class HeldEncodes:
    """The target's encode_prompt, held for inputs of LARGE_INPUT_CHARS or more until the test
    opens the gate; counts how many run at once, and the calls that reached Serving.encode."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self._lock = threading.Lock()
        self.running = self.most = self.entered = self.received = 0
        encode_prompt, encode = TargetModel.encode_prompt, Serving.encode

        def held(target: TargetModel, prompt: str) -> list[int]:
            if len(prompt) >= LARGE_INPUT_CHARS:
                with self._lock:
                    self.entered += 1
                    self.running += 1
                    self.most = max(self.most, self.running)
                try:
                    assert self.gate.wait(TIMEOUT), "the gate was never opened"
                finally:
                    with self._lock:
                        self.running -= 1
            return encode_prompt(target, prompt)

        async def counted(serving: Serving, *args):  # type: ignore[no-untyped-def]
            self.received += 1
            return await encode(serving, *args)

        monkeypatch.setattr(TargetModel, "encode_prompt", held)
        monkeypatch.setattr(Serving, "encode", counted)

    async def until(self, condition: Callable[[], bool]) -> None:
        """Return once `condition()` holds (a bound that a passing run never reaches)."""
        async with asyncio.timeout(TIMEOUT):
            while not condition():
                await asyncio.sleep(0.005)


@pytest.fixture
def held(monkeypatch) -> Iterator[HeldEncodes]:
    encodes = HeldEncodes(monkeypatch)
    yield encodes
    encodes.gate.set()


LARGE = "word " * (LARGE_INPUT_CHARS // 5 + 1)  # over the tiny model's 512 tokens


async def test_large_inputs_take_permits_and_short_ones_never_wait(start_with_limits, held) -> None:
    server = await start_with_limits(max_prompt_chars=400_000, tokenize_concurrency=2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        large = [
            asyncio.ensure_future(refusal(stub.Tokenize(pb.TokenizeRequest(prompt=LARGE))))
            for _ in range(5)
        ]
        await held.until(lambda: held.received == 5 and held.entered >= 2)
        # Both permits are held: a short input and the health check are answered all the same.
        short = await stub.Tokenize(pb.TokenizeRequest(prompt="word " * 20), timeout=TIMEOUT)
        assert short.token_count > 0
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert held.entered == 2  # the other three wait for a permit
        held.gate.set()
        refusals = await asyncio.gather(*large)
    assert all("tokens exceed the server limit" in error.details() for error in refusals)
    assert (held.entered, held.most) == (5, 2)


async def test_a_caller_that_leaves_keeps_its_permit_until_its_thread_is_done(
    start_with_limits, held
) -> None:
    """A thread cannot be stopped: the permit goes back when it ends, not when its caller
    leaves (else huge inputs sent and cancelled at once would each keep a core busy)."""
    server = await start_with_limits(max_prompt_chars=400_000, tokenize_concurrency=1)
    cancelled = {"api": "grpc", "finish_reason": "none", "code": "CANCELLED"}
    cancelled["model_name"] = server.metrics.model_name
    requests_total = "kenspec_requests_total"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        first = stub.Generate(pb.GenerateRequest(prompt=LARGE), timeout=TIMEOUT)
        await held.until(lambda: held.entered == 1)
        first.cancel()
        registry = server.metrics.registry
        await held.until(lambda: registry.get_sample_value(requests_total, cancelled) == 1)
        second = asyncio.ensure_future(refusal(stub.Tokenize(pb.TokenizeRequest(prompt=LARGE))))
        await held.until(lambda: held.received == 2)
        held.gate.set()
        error = await second
    assert "tokens exceed the server limit" in error.details()
    assert (held.entered, held.most) == (2, 1)


async def test_many_huge_inputs_at_once_leave_health_answering_as_at_rest(
    start_with_limits,
) -> None:
    # An operator's character limit well above what the tiny model's tokens allow, so that
    # huge inputs within it are tokenized (then refused for their token count).
    server = await start_with_limits(max_prompt_chars=400_000, tokenize_concurrency=2)
    # A new connection per HTTP check: on a kept-alive one, delayed acknowledgements add a
    # constant 40 ms or so to every answer, which would hide what the load adds.
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(timeout=TIMEOUT, limits=fresh) as client,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        url = f"http://127.0.0.1:{server.http_port}/health"
        health = health_pb2_grpc.HealthStub(channel)
        stub = pb_grpc.GeneratorStub(channel)

        async def http() -> None:
            assert (await client.get(url)).status_code == 200

        async def grpc_health() -> None:
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING

        checks = {"http": http, "grpc": grpc_health}
        at_rest = await health_seconds(checks, 20)
        within, over = "ab" * 195_000, "ab" * 450_000  # 390,000 and 900,000 characters
        load = [
            stub.Tokenize(pb.TokenizeRequest(prompt=text), timeout=TIMEOUT)
            for text in [within, over] * 6
        ]
        loaded = asyncio.ensure_future(asyncio.gather(*(refusal(call) for call in load)))
        under_load: dict[str, list[float]] = {name: [] for name in checks}
        while not loaded.done():
            for name, seconds in (await health_seconds(checks, 1)).items():
                under_load[name] += seconds
        refusals = await loaded
    assert sorted(error.details().split(":")[0] for error in refusals) == ["prompt"] * 12
    for name in checks:
        rest, loaded_ = statistics.median(at_rest[name]), statistics.median(under_load[name])
        assert len(under_load[name]) >= 3  # measured while the load lasted
        # Generous and relative: the machine's speed and its other work cannot decide it.
        assert loaded_ < max(10 * rest, 0.05), (name, at_rest[name], under_load[name])

"""TLS and mutual TLS handshakes (certificates from conftest's `pki`), bearer tokens, and the
server's deadline cap."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kenspec.api import generator_pb2 as pb
from kenspec.client import AsyncClient, AuthenticationError, ServerUnavailable
from kenspec.server import security
from kenspec.server.lifecycle import KenspecServer

TIMEOUT = 60  # seconds; bounds waits that a passing run never reaches


async def generate_text(client: AsyncClient) -> str:
    completion = await client.generate_text("Hello world", max_new_tokens=4, timeout=30)
    return completion.text


async def test_tls_handshake(start_server, pki) -> None:
    server, _ = await start_server(tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]))
    address = f"localhost:{server.port}"
    async with AsyncClient(address, tls=True, tls_ca=pki["ca"]) as client:
        assert len(await generate_text(client)) >= 0
        assert (await client.model_info()).vocab_size > 0
    async with AsyncClient(f"127.0.0.1:{server.port}", timeout=5) as plaintext:
        with pytest.raises(ServerUnavailable):
            await generate_text(plaintext)


async def test_mutual_tls_requires_a_client_certificate_from_the_ca(start_server, pki) -> None:
    server, _ = await start_server(
        tls_cert=str(pki["server_cert"]),
        tls_key=str(pki["server_key"]),
        tls_client_ca=str(pki["ca"]),
    )
    address = f"localhost:{server.port}"
    async with AsyncClient(
        address, tls=True, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"]
    ) as client:
        await generate_text(client)
    async with AsyncClient(address, tls=True, tls_ca=pki["ca"], timeout=5) as anonymous:
        with pytest.raises(ServerUnavailable):
            await generate_text(anonymous)
    async with AsyncClient(
        address,
        tls=True,
        tls_ca=pki["ca"],
        tls_cert=pki["stranger_cert"],
        tls_key=pki["stranger_key"],
        timeout=5,
    ) as stranger:
        with pytest.raises(ServerUnavailable):
            await generate_text(stranger)


@pytest.fixture
def tokens_file(tmp_path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# allowed\nalpha-token\n\nbeta-token\n")
    return path


async def test_bearer_tokens(start_server, tokens_file) -> None:
    server, _ = await start_server(auth_tokens_file=str(tokens_file))
    address = f"127.0.0.1:{server.port}"
    for token in ("alpha-token", "beta-token"):
        async with AsyncClient(address, token=token) as client:
            await generate_text(client)
            await client.model_info()
    for token, message in ((None, "missing"), ("wrong", "invalid"), ("alpha-token-x", "invalid")):
        async with AsyncClient(address, token=token) as client:
            with pytest.raises(AuthenticationError, match=message):
                await generate_text(client)
            with pytest.raises(AuthenticationError):
                await client.tokenize("x")
    # Health checks need no token (load balancers and kubelets probe without one).
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_an_api_key_is_accepted_beside_the_tokens_file_on_both_apis(
    start_server, tokens_file
) -> None:
    server, _ = await start_server(auth_tokens_file=str(tokens_file), api_key="sk-k1", port=0)
    address = f"127.0.0.1:{server.port}"
    for token in ("sk-k1", "alpha-token"):
        async with AsyncClient(address, token=token) as client:
            assert await generate_text(client)
    async with AsyncClient(address, token="sk-k2") as client:
        with pytest.raises(AuthenticationError, match="invalid"):
            await generate_text(client)
    base = f"http://127.0.0.1:{server.http_port}/v1/models"
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        assert (await http.get(base, headers={"Authorization": "Bearer sk-k1"})).status_code == 200
        assert (await http.get(base, headers={"Authorization": "Bearer sk-k2"})).status_code == 401
        assert (await http.get(base)).status_code == 401


async def test_calls_refused_for_their_token_are_counted(start_server, tokens_file) -> None:
    """The interceptor refuses before any handler runs: a Generate call refused so is counted
    as UNAUTHENTICATED all the same; a Tokenize call, not a generate call, is not."""
    server, _ = await start_server(auth_tokens_file=str(tokens_file))
    labels = {"api": "grpc", "finish_reason": "none", "code": "UNAUTHENTICATED"}
    labels["model_name"] = server.metrics.model_name

    def counted() -> float:
        return server.metrics.registry.get_sample_value("kenspec_requests_total", labels) or 0

    async with AsyncClient(f"127.0.0.1:{server.port}", token="wrong") as client:
        with pytest.raises(AuthenticationError):
            await client.tokenize("x")
        assert counted() == 0
        for expected in (1, 2):
            with pytest.raises(AuthenticationError):
                await generate_text(client)
            assert counted() == expected


def test_empty_tokens_file_is_refused(tmp_path, base_settings) -> None:
    empty = tmp_path / "tokens"
    empty.write_text("# nobody\n")
    with pytest.raises(ValueError, match="no tokens"):
        KenspecServer(base_settings.replace(auth_tokens_file=str(empty)))


async def test_server_caps_the_deadline(start_server, held_passes, collect, prompt_request):
    """No stream runs past --max-deadline-s, whatever deadline its client set (none here): one
    waiting for a slot is cut in the queue, one generating after the round in flight. The
    passes are held, so neither could finish first on any machine."""
    _, stub = await start_server(max_deadline_s=0.5, max_concurrent_streams=1)
    request = prompt_request(max_new_tokens=390)
    request.speculation.mode = pb.SPECULATION_MODE_OFF
    generating = stub.Generate(request)  # no client deadline at all
    await held_passes.arrival(1)  # it holds the only slot; its first pass waits at the gate
    with pytest.raises(grpc.aio.AioRpcError) as queued:
        await collect(stub.Generate(prompt_request(max_new_tokens=2)))  # waits for that slot
    assert queued.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "0.5 s" in queued.value.details()
    # The generating stream started first: its 0.5 s are up too. Its round in flight ends it.
    held_passes.open()
    received = []

    async def read() -> None:
        async for response in generating:
            received.append(response)

    with pytest.raises(grpc.aio.AioRpcError) as error:
        await asyncio.wait_for(read(), TIMEOUT)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "0.5 s" in error.value.details()
    assert len(received) <= 1  # the cap is overshot by one round at most


def test_token_comparison_does_not_depend_on_the_presented_length(monkeypatch) -> None:
    """compare_digest returns early on arguments of different lengths: every comparison is of
    equal-length digests, against every allowed token, whatever length was presented."""
    compared: list[tuple[int, int]] = []
    real = security.hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", recording)
    tokens = (b"alpha-token", b"a-much-longer-beta-token")
    for presented, allowed in (
        (b"alpha-token", True),
        (b"a-much-longer-beta-token", True),
        (b"", False),
        (b"a", False),
        (b"alpha-toke", False),
        (b"alpha-token-x", False),
        (b"x" * 1000, False),
    ):
        compared.clear()
        assert security.token_allowed(presented, tokens) is allowed
        assert len(compared) == len(tokens)  # every allowed token, even after a match
        assert len(set(compared)) == 1 and compared[0][0] == compared[0][1], compared

"""The container health check (`python -m server.healthcheck`) against real in-process servers
with TLS, mutual TLS and tokens: it speaks as the server listens, read from the server's own
settings (certificates from conftest's `pki`)."""

from __future__ import annotations

import asyncio

from kenspec.server import healthcheck
from kenspec.server.settings import parse_settings


def tls(pki, **more: str) -> dict[str, str]:
    return {"tls_cert": str(pki["server_cert"]), "tls_key": str(pki["server_key"]), **more}


async def test_healthy_over_tls_with_the_servers_settings(start_server, pki) -> None:
    server, _ = await start_server(**tls(pki))
    address = f"127.0.0.1:{server.port}"  # the certificate names localhost: checked for that
    assert await asyncio.to_thread(healthcheck.check, address, 10.0, server.settings)
    # Plaintext, as the probe spoke before, never gets an answer from a TLS port.
    assert await asyncio.to_thread(healthcheck.check, address, 2.0) is False


async def test_a_draining_tls_server_is_unhealthy(start_server, pki) -> None:
    server, _ = await start_server(**tls(pki))
    address = f"127.0.0.1:{server.port}"
    await server.health.enter_graceful_shutdown()
    assert await asyncio.to_thread(healthcheck.check, address, 10.0, server.settings) is False


async def test_mutual_tls_and_tokens(start_server, pki, tmp_path) -> None:
    """With --tls-client-ca the probe presents the server's certificate (signed by that CA
    here); health is exempt from tokens, so it needs none."""
    tokens = tmp_path / "tokens"
    tokens.write_text("secret-token\n")
    server, _ = await start_server(
        **tls(pki, tls_client_ca=str(pki["ca"]), auth_tokens_file=str(tokens))
    )
    address = f"127.0.0.1:{server.port}"
    assert await asyncio.to_thread(healthcheck.check, address, 10.0, server.settings)
    stranger = {"client_cert": str(pki["stranger_cert"]), "client_key": str(pki["stranger_key"])}
    assert not await asyncio.to_thread(healthcheck.check, address, 2.0, server.settings, **stranger)
    # Without the client CA in its settings the probe offers no certificate: refused.
    one_way = parse_settings([], {"KENSPEC_TLS_CERT": str(pki["server_cert"])})
    assert not await asyncio.to_thread(healthcheck.check, address, 2.0, one_way)


async def test_main_reads_the_servers_environment(start_server, pki, monkeypatch) -> None:
    """The container sets KENSPEC_* for the server; the HEALTHCHECK command has no arguments
    and finds the port and the TLS files there."""
    server, _ = await start_server(**tls(pki))  # on 127.0.0.1, where 0.0.0.0 is reached
    for name, value in {
        "KENSPEC_HOST": "0.0.0.0",
        "KENSPEC_GRPC_PORT": str(server.port),
        "KENSPEC_TLS_CERT": str(pki["server_cert"]),
        "KENSPEC_TLS_KEY": str(pki["server_key"]),
    }.items():
        monkeypatch.setenv(name, value)
    assert await asyncio.to_thread(healthcheck.main, []) == 0
    # Server flags after "--" count as the server's own would: no TLS, so no answer.
    assert await asyncio.to_thread(healthcheck.main, ["--timeout", "2", "--", "--tls-cert="]) == 1
    monkeypatch.setenv("KENSPEC_TLS_CERT", str(pki["stranger_cert"]))  # not what it serves
    assert await asyncio.to_thread(healthcheck.main, ["--timeout", "2"]) == 1


def test_the_name_checked_is_one_the_certificate_holds(pki) -> None:
    assert healthcheck.certificate_name(str(pki["server_cert"]), "127.0.0.1") == "localhost"
    assert healthcheck.certificate_name(str(pki["stranger_cert"]), "127.0.0.1") == "stranger"
    settings = parse_settings([], {"KENSPEC_HOST": "::", "KENSPEC_GRPC_PORT": "7"})
    assert healthcheck.local_address(settings) == "[::1]:7"
    assert healthcheck.probe_for(settings).root_certificates is None  # plaintext

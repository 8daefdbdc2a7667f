"""TLS and mTLS, with a throwaway CA made by the openssl command line."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from kenspec.client import AsyncClient, ServerUnavailable

if TYPE_CHECKING:
    from conftest import StartFake

TIMEOUT = 10.0
SERVER_NAME = "kenspec.test"  # the server certificate has no IP SAN: 127.0.0.1 does not match

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.server_key.read_bytes(), self.server_cert.read_bytes())],
            root_certificates=self.ca.read_bytes(),
            require_client_auth=True,
        )


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def _issue(directory: Path, name: str, extensions: str) -> None:
    """name.key + name.pem signed by ca.pem."""
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
             cwd=directory)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext",
             cwd=directory)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=kenspec-test-ca",
             "-days", "1", cwd=directory)  # fmt: skip
    _issue(directory, "server", f"subjectAltName=DNS:{SERVER_NAME},DNS:localhost\n"
           "extendedKeyUsage=serverAuth\n")  # fmt: skip
    _issue(directory, "client", "extendedKeyUsage=clientAuth\n")
    return Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )


async def test_mutual_tls_with_server_name_override(pki: Pki, start_fake_server: StartFake) -> None:
    fake = await start_fake_server(credentials=pki.server_credentials())
    client = AsyncClient(
        fake.address,
        tls_ca=pki.ca,
        tls_cert=pki.client_cert,
        tls_key=pki.client_key,
        tls_server_name=SERVER_NAME,
        token="t",
    )
    async with client:
        info = await asyncio.wait_for(client.model_info(), TIMEOUT)

    assert info.model == "fake"
    assert fake.servicer.metadata[-1]["authorization"] == "Bearer t"


@pytest.mark.parametrize("case", ["no client certificate", "wrong server name", "plaintext"])
async def test_failed_handshakes_are_server_unavailable(
    pki: Pki, start_fake_server: StartFake, case: str
) -> None:
    fake = await start_fake_server(credentials=pki.server_credentials())
    options_by_case: dict[str, dict[str, object]] = {
        "no client certificate": {"tls_ca": pki.ca, "tls_server_name": SERVER_NAME},
        "wrong server name": {"tls_ca": pki.ca, "tls_cert": pki.client_cert,
                              "tls_key": pki.client_key},
        "plaintext": {},
    }  # fmt: skip
    kwargs = options_by_case[case]
    async with AsyncClient(fake.address, **kwargs) as client:  # type: ignore[arg-type]
        with pytest.raises(ServerUnavailable):
            await asyncio.wait_for(client.model_info(), TIMEOUT)


async def test_resolved_hostname_list_verifies_that_hostname(
    pki: Pki, start_fake_server: StartFake
) -> None:
    # "localhost:a,localhost:b" becomes an ipv4: target; TLS must still check "localhost".
    credentials = pki.server_credentials()
    servers = [await start_fake_server(name, credentials) for name in ("a", "b")]
    ports = [server.address.rsplit(":", 1)[1] for server in servers]
    client = AsyncClient(
        [f"localhost:{port}" for port in ports],
        tls_ca=pki.ca,
        tls_cert=pki.client_cert,
        tls_key=pki.client_key,
    )
    seen = set()
    async with client:
        for _ in range(20):
            seen.add((await asyncio.wait_for(client.model_info(), TIMEOUT)).model)
            if seen == {"a", "b"}:
                break

    assert seen == {"a", "b"}

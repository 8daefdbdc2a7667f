"""`python -m server.healthcheck [address] [options] [-- server flags]`: exit 0 when the gRPC
health service says SERVING.

Used by the container HEALTHCHECK; needs no grpc_health_probe binary. It reads the server's
own settings (its KENSPEC_* variables, and any server flags given after `--`), so the
probe speaks as the server listens: plaintext, TLS trusting the server's certificate (checked
against a name that certificate holds, since the probe dials 127.0.0.1), and with
--tls-client-ca a client certificate (the server's own unless --client-cert says another).
Health needs no bearer token: it is exempt from --auth-tokens-file.
"""

from __future__ import annotations

import argparse
import ipaddress
import ssl
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kenspec.server.settings import Settings, parse_settings


@dataclass(frozen=True, slots=True)
class Probe:
    """How to reach the health service: plaintext when `root_certificates` is None."""

    address: str
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str = ""  # the name checked against the server's certificate; "": the host's


def local_address(settings: Settings) -> str:
    """The address of the server's gRPC port from inside its host or container."""
    host, port = settings.server.host, settings.server.grpc_port
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def probe_for(
    settings: Settings,
    address: str = "",
    *,
    server_name: str = "",
    client_cert: str = "",
    client_key: str = "",
) -> Probe:
    """The probe for a server run with `settings` (at `address`, else its local address)."""
    address = address or local_address(settings)
    security = settings.security
    if not security.tls_cert:
        return Probe(address)
    chain = key = None
    if security.tls_client_ca:  # mutual TLS: the server refuses a handshake without one
        chain = Path(client_cert or security.tls_cert).read_bytes()
        key = Path(client_key or security.tls_key).read_bytes()
    host = address.rsplit(":", 1)[0].strip("[]")
    return Probe(
        address,
        # The server's own chain as the trust anchor: gRPC accepts a chain that ends at a
        # trusted certificate, so this holds for a self-signed one and for a CA-signed one.
        root_certificates=Path(security.tls_cert).read_bytes(),
        certificate_chain=chain,
        private_key=key,
        server_name=server_name or certificate_name(security.tls_cert, host),
    )


def certificate_name(cert: str, host: str) -> str:
    """A name the certificate is valid for: "" when it already covers `host` (an IP address
    in its SANs), else its first DNS name (a wildcard's with a label filled in), else its
    common name."""
    try:
        decoded = ssl._ssl._test_decode_cert(cert)  # type: ignore[attr-defined]
    except (AttributeError, ssl.SSLError, OSError):
        return ""  # the host's own name is checked, as any client would
    sans = decoded.get("subjectAltName", ())
    if any(kind == "IP Address" and _same_ip(value, host) for kind, value in sans):
        return ""
    for kind, value in sans:
        if kind == "DNS":
            return "health" + value[1:] if value.startswith("*.") else value
    for rdn in decoded.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return ""


def _same_ip(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.strip()) == ipaddress.ip_address(b)
    except ValueError:
        return False


def check(
    address: str, timeout: float = 3.0, settings: Settings | None = None, **probe: str
) -> bool:
    """Whether the health service at `address` says SERVING; with `settings`, reached as a
    server run with them listens (TLS, client certificate); `probe`: probe_for's options."""
    try:
        target = probe_for(settings, address, **probe) if settings is not None else Probe(address)
    except OSError as error:  # a certificate file it cannot read
        print(f"unhealthy: {error}", file=sys.stderr)
        return False
    return probe_health(target, timeout)


def probe_health(probe: Probe, timeout: float) -> bool:
    with _channel(probe) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as error:
            print(f"unhealthy: {error.code().name}: {error.details()}", file=sys.stderr)
            return False
    serving = response.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(
            f"unhealthy: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}",
            file=sys.stderr,
        )
    return serving


def _channel(probe: Probe) -> grpc.Channel:
    if probe.root_certificates is None:
        return grpc.insecure_channel(probe.address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=probe.root_certificates,
        private_key=probe.private_key,
        certificate_chain=probe.certificate_chain,
    )
    options = [("grpc.ssl_target_name_override", probe.server_name)] if probe.server_name else []
    return grpc.secure_channel(probe.address, credentials, options=options)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kenspec.server.healthcheck",
        description="Exit 0 when the kenspec server's gRPC health service says SERVING. Reads "
        "the server's KENSPEC_* variables; server flags may follow a '--'.",
    )
    parser.add_argument("address", nargs="?", default="", help="default: the server's port")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    parser.add_argument("--server-name", default="", help="name to check the certificate for")
    parser.add_argument("--client-cert", default="", help="with mutual TLS (default: the server's)")
    parser.add_argument("--client-key", default="", help="key of --client-cert")
    given = list(sys.argv[1:] if argv is None else argv)
    cut = given.index("--") if "--" in given else len(given)
    args, server_flags = parser.parse_args(given[:cut]), given[cut + 1 :]
    settings = parse_settings(server_flags)
    healthy = check(
        args.address,
        args.timeout,
        settings,
        server_name=args.server_name,
        client_cert=args.client_cert,
        client_key=args.client_key,
    )
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())

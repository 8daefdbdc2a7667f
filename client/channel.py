"""Everything a client needs to open its channel: target, options, TLS, auth metadata.

Built once per client by `channel_spec()` and shared by the sync and the asyncio client, so
both connect, balance and authenticate identically.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from .addresses import build_target

DEFAULT_ADDRESS = "127.0.0.1:50051"
TOKEN_ENV = "KENSPEC_TOKEN"
USER_AGENT = "kenspec-client/0.1"

# Call metadata as grpc takes it: (key, value) pairs, keys lowercase.
Pairs = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS settings; `ca` None means the system roots, `cert`+`key` enable mTLS."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None  # verify the server certificate against this name


@dataclass(frozen=True, slots=True)
class ChannelSpec:
    address: str  # what the user asked for, for error messages
    target: str
    options: tuple[tuple[str, str | int], ...]
    credentials: grpc.ChannelCredentials | None  # None = plaintext
    metadata: Pairs  # sent with every call
    # (address, target reaching it alone) per address; more than one: sessions are routed
    endpoints: tuple[tuple[str, str], ...] = ()

    @property
    def routed(self) -> bool:
        """Whether calls with a session id pick their own address (several were given)."""
        return len(self.endpoints) > 1

    def options_alone(self) -> tuple[tuple[str, str | int], ...]:
        """The options of a channel to one of the addresses: no balancing policy."""
        return tuple(option for option in self.options if option[0] != "grpc.lb_policy_name")


def tls_config(
    tls: bool,
    ca: str | Path | None,
    cert: str | Path | None,
    key: str | Path | None,
    server_name: str | None,
) -> TlsConfig | None:
    """The TLS settings the client flags ask for; None (plaintext) when none is set."""
    if not (tls or ca or cert or key or server_name):
        return None
    return TlsConfig(
        ca=Path(ca) if ca else None,
        cert=Path(cert) if cert else None,
        key=Path(key) if key else None,
        server_name=server_name,
    )


def channel_spec(
    addresses: str | Sequence[str], tls: TlsConfig | None, token: str | None
) -> ChannelSpec:
    """Resolve addresses, load TLS files, and pick the token (`KENSPEC_TOKEN` when None)."""
    target = build_target(addresses)
    server_name = tls.server_name if tls else None
    if tls and server_name is None and target.resolved_hostnames:
        server_name = _single_hostname(target.resolved_hostnames)
    options: list[tuple[str, str | int]] = [
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.primary_user_agent", USER_AGENT),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    address = addresses if isinstance(addresses, str) else ",".join(addresses)
    credentials = _credentials(tls) if tls else None
    return ChannelSpec(
        address,
        target.uri,
        tuple(options),
        credentials,
        _auth_metadata(token),
        target.endpoints,
    )


def _single_hostname(hostnames: frozenset[str]) -> str:
    # Once names are replaced by IPs, TLS can only check one name for every backend.
    if len(hostnames) > 1:
        raise ValueError(
            f"TLS across several hostnames {sorted(hostnames)} needs tls_server_name "
            "(the name every server's certificate carries)"
        )
    return next(iter(hostnames))


def _credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    if (tls.cert is None) != (tls.key is None):
        raise ValueError("mTLS needs both a client certificate and its key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca),
        private_key=_read(tls.key),
        certificate_chain=_read(tls.cert),
    )


def _read(path: Path | None) -> bytes | None:
    return path.read_bytes() if path is not None else None


def _auth_metadata(token: str | None) -> Pairs:
    # Plain metadata rather than call credentials: grpc refuses those on plaintext channels,
    # and a token over plaintext on a trusted network is a legitimate setup.
    if token is None:
        token = os.environ.get(TOKEN_ENV, "")
    return (("authorization", f"Bearer {token}"),) if token else ()

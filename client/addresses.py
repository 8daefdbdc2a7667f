"""Turn the user's address list into one gRPC channel target.

gRPC balances only across the addresses a single channel's resolver returns, so several
addresses become one static target that the round_robin policy spreads calls over:

    "127.0.0.1:5001"                     -> "127.0.0.1:5001"  (any gRPC target passes through)
    "127.0.0.1:5001,127.0.0.1:5002"      -> "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    ["[::1]:5001", "[::1]:5002"]         -> "ipv6:[::1]:5001,[::1]:5002"
    "localhost:5001,localhost:5002"      -> "ipv4:127.0.0.1:5001,127.0.0.1:5002"  (resolved once)

Each entry also keeps a target of its own (`Target.endpoints`), for calls that must reach one
chosen server: a call with a session id goes to the address the session hashes to
(client/session_affinity.py), on a channel to that address alone.

Limitations: hostnames in a list of several are resolved once, when the client is built
(preferring IPv4), and never again; a list cannot mix IPv4 and IPv6. To follow DNS changes,
pass one ``dns:///name:port`` target instead: round_robin then spreads over all its records.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Target:
    """A channel target plus what TLS should verify when hostnames were resolved away."""

    uri: str
    resolved_hostnames: frozenset[str]  # hostnames replaced by IPs (TLS must verify these)
    # (the address as given, a target that reaches it alone), one per address, in order
    endpoints: tuple[tuple[str, str], ...] = ()


def split_addresses(addresses: str | Sequence[str]) -> list[str]:
    """Flatten a string or list of comma-separated addresses; ``ValueError`` when empty."""
    parts = [addresses] if isinstance(addresses, str) else list(addresses)
    flat = [piece.strip() for part in parts for piece in part.split(",")]
    flat = [address for address in flat if address]
    if not flat:
        raise ValueError("no server address given")
    return flat


def build_target(addresses: str | Sequence[str]) -> Target:
    """The channel target for one or several addresses (see the module docstring)."""
    flat = split_addresses(addresses)
    if len(flat) == 1:
        return Target(flat[0], frozenset(), ((flat[0], flat[0]),))
    endpoints = [_resolve(*_split_host_port(address)) for address in flat]
    families = {family for family, _, _ in endpoints}
    if len(families) > 1:
        raise ValueError(f"cannot balance across both IPv4 and IPv6 addresses: {flat}")
    scheme = "ipv6" if families == {socket.AF_INET6} else "ipv4"
    hosts = ",".join(hostport for _, hostport, _ in endpoints)
    resolved = frozenset(name for _, _, name in endpoints if name is not None)
    pairs = zip(flat, endpoints, strict=True)
    alone = tuple((address, f"{scheme}:{hostport}") for address, (_, hostport, _) in pairs)
    return Target(f"{scheme}:{hosts}", resolved, alone)


def _split_host_port(address: str) -> tuple[str, int]:
    if "://" in address or address.startswith(("unix:", "ipv4:", "ipv6:", "dns:")):
        raise ValueError(
            f"{address!r}: a list of several addresses takes host:port entries; "
            "pass a URI target on its own"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{address!r}: expected host:port (e.g. 127.0.0.1:50051 or [::1]:50051)")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _resolve(host: str, port: int) -> tuple[socket.AddressFamily, str, str | None]:
    """(family, "ip:port" in target syntax, the hostname if it had to be resolved)."""
    try:
        ip = ipaddress.ip_address(host)
        name = None
    except ValueError:
        ip = _lookup(host, port)
        name = host
    if ip.version == 6:
        return socket.AF_INET6, f"[{ip}]:{port}", name
    return socket.AF_INET, f"{ip}:{port}", name


def _lookup(host: str, port: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve {host!r}: {error}") from error
    ips = [ipaddress.ip_address(info[4][0]) for info in infos]
    # "localhost" usually resolves to both ::1 and 127.0.0.1; one entry per name, IPv4 first,
    # keeps each server weighted once.
    return min(ips, key=lambda ip: ip.version)

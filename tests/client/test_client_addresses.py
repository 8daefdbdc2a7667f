"""Address lists -> one gRPC target (pure functions, no server)."""

from __future__ import annotations

import pytest

from kenspec.client.addresses import build_target, split_addresses


@pytest.mark.parametrize(
    ("addresses", "uri"),
    [
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("dns:///kenspec.internal:443", "dns:///kenspec.internal:443"),
        ("unix:/tmp/kenspec.sock", "unix:/tmp/kenspec.sock"),
        (" 10.0.0.1:1 , 10.0.0.2:2 ", "ipv4:10.0.0.1:1,10.0.0.2:2"),
        (["10.0.0.1:1", "10.0.0.2:2,10.0.0.3:3"], "ipv4:10.0.0.1:1,10.0.0.2:2,10.0.0.3:3"),
        (["[::1]:1", "[::1]:2"], "ipv6:[::1]:1,[::1]:2"),
        ("localhost:1,127.0.0.1:2", "ipv4:127.0.0.1:1,127.0.0.1:2"),
    ],
)
def test_build_target(addresses: str | list[str], uri: str) -> None:
    assert build_target(addresses).uri == uri


def test_resolved_hostnames_are_remembered_for_tls() -> None:
    target = build_target("localhost:1,127.0.0.1:2")
    assert target.resolved_hostnames == {"localhost"}
    assert build_target("127.0.0.1:1,127.0.0.1:2").resolved_hostnames == frozenset()


@pytest.mark.parametrize(
    ("addresses", "message"),
    [
        ("", "no server address"),
        ([" ", ","], "no server address"),
        ("127.0.0.1:1,dns:///x:2", "URI target on its own"),
        ("127.0.0.1,127.0.0.1:2", "expected host:port"),
        ("127.0.0.1:1,[::1]:2", "both IPv4 and IPv6"),
        ("127.0.0.1:1,no-such-host.invalid:2", "cannot resolve"),
    ],
)
def test_bad_address_lists(addresses: str | list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_target(addresses)


def test_split_addresses_flattens_lists_and_commas() -> None:
    assert split_addresses(["a:1,b:2", " c:3 "]) == ["a:1", "b:2", "c:3"]

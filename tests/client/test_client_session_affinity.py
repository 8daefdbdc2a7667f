"""Session ids: sent as x-session-id metadata on every call, and, over several addresses, the
rendezvous choice of one address per session with its fallbacks (client/session_affinity.py)."""

from __future__ import annotations

import asyncio
import io
import re
import sys
from collections import Counter
from typing import TYPE_CHECKING

import pytest

from kenspec.client import AsyncClient, Client, ServerUnavailable
from kenspec.client.cli import main
from kenspec.client.session_affinity import SESSION_KEY, check_session_id, rendezvous_order

if TYPE_CHECKING:
    from conftest import FakeServer, StartFake, StartThreadedFake

TIMEOUT = 10  # seconds; no test here waits that long when it passes
ADDRESSES = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
SESSIONS = [f"chat-{index}" for index in range(300)]


# -- the choice itself -------------------------------------------------------------------------


def test_the_order_is_fixed_by_the_session_and_the_addresses_alone() -> None:
    # Pinned: every client process, of any version, must pick the same address for a session.
    assert rendezvous_order("chat-1", ["a:1", "b:1", "c:1"]) == ["c:1", "b:1", "a:1"]
    for session in SESSIONS[:20]:
        order = rendezvous_order(session, ADDRESSES)
        assert sorted(order) == sorted(ADDRESSES)
        assert rendezvous_order(session, ADDRESSES[::-1]) == order  # the list's order is no input


def test_sessions_spread_over_every_address() -> None:
    homes = Counter(rendezvous_order(session, ADDRESSES)[0] for session in SESSIONS)
    assert set(homes) == set(ADDRESSES)
    assert min(homes.values()) >= len(SESSIONS) // 5, homes  # about a third each


def test_removing_an_address_moves_only_the_sessions_it_held() -> None:
    removed, *kept = ADDRESSES
    for session in SESSIONS:
        before = rendezvous_order(session, ADDRESSES)
        # each session's fallback order is its order without the address that went away
        assert rendezvous_order(session, kept) == [a for a in before if a != removed]


@pytest.mark.parametrize("session", ["0f8e2b9c4d", "user-42/chat-7", "a" * 128])
def test_good_session_ids(session: str) -> None:
    assert check_session_id(session) == session


@pytest.mark.parametrize("session", ["two words", "tab\tbed", "caf\u00e9", "line\n", "a" * 129])
def test_session_ids_that_cannot_travel_as_a_header(session: str) -> None:
    with pytest.raises(ValueError, match="session_id must be 1-128 visible ASCII characters"):
        check_session_id(session)


def session_homed_at(address: str, addresses: list[str]) -> str:
    """The first chat-N session whose first choice is `address` (one in a few: bounded)."""
    return next(s for s in SESSIONS if rendezvous_order(s, addresses)[0] == address)


# -- the blocking client -----------------------------------------------------------------------


def test_a_session_s_calls_all_reach_its_address(start_threaded_fake: StartThreadedFake) -> None:
    servers = {s.address: s for s in (start_threaded_fake(name) for name in "abc")}
    addresses = list(servers)
    session = SESSIONS[0]
    home = servers[rendezvous_order(session, addresses)[0]]
    with Client(addresses, timeout=TIMEOUT, session_id=session) as client:
        for turn in range(5):
            client.generate_text(f"turn {turn}")
        assert client.model_info().model == home.servicer.name

    assert len(home.servicer.requests) == 5
    assert [m[SESSION_KEY] for m in home.servicer.metadata] == [session] * 6
    assert all(not s.servicer.metadata for s in servers.values() if s is not home)


def test_a_call_s_own_session_id_overrides_the_client_s(
    start_threaded_fake: StartThreadedFake,
) -> None:
    servers = {s.address: s for s in (start_threaded_fake(name) for name in "ab")}
    addresses = list(servers)
    first, second = (session_homed_at(address, addresses) for address in addresses)
    with Client(addresses, timeout=TIMEOUT, session_id=first) as client:
        client.generate_text("mine")
        client.generate_text("theirs", session_id=second)
        client.generate_text("none", session_id="")  # balanced, and no metadata

    sent = [m.get(SESSION_KEY) for s in servers.values() for m in s.servicer.metadata]
    assert sorted(sent, key=str) == sorted([first, second, None], key=str)
    for address, session in zip(addresses, (first, second), strict=True):
        assert session in [m.get(SESSION_KEY) for m in servers[address].servicer.metadata]


def test_a_session_falls_back_when_its_address_is_down(
    start_threaded_fake: StartThreadedFake, dead_address: str
) -> None:
    live = start_threaded_fake("live")
    addresses = [dead_address, live.address]
    session = session_homed_at(dead_address, addresses)
    with Client(addresses, timeout=TIMEOUT, session_id=session) as client:
        assert client.generate_text("still answered").text == "Hello still answered"
        assert client.model_info().model == "live"
    assert [m[SESSION_KEY] for m in live.servicer.metadata] == [session, session]


def test_with_every_address_down_the_error_names_the_last_tried(dead_address: str) -> None:
    other = dead_address.rsplit(":", 1)[0] + ":1"  # port 1: nothing listens there either
    addresses = [dead_address, other]
    session = SESSIONS[0]
    with (
        Client(addresses, timeout=TIMEOUT, session_id=session) as client,
        pytest.raises(ServerUnavailable) as caught,
    ):
        client.generate_text("hi")
    assert caught.value.address == rendezvous_order(session, addresses)[-1]


def test_one_address_gets_the_metadata_only(threaded_fake: FakeServer) -> None:
    with Client(threaded_fake.address, timeout=TIMEOUT, session_id="s-1") as client:
        client.generate_text("hi")
        client.generate_text("hi", session_id="")
    assert [m.get(SESSION_KEY) for m in threaded_fake.servicer.metadata] == ["s-1", None]


def test_a_bad_session_id_fails_before_anything_is_sent(threaded_fake: FakeServer) -> None:
    with pytest.raises(ValueError, match="session_id"):
        Client(threaded_fake.address, session_id="two words")
    with (
        Client(threaded_fake.address, timeout=TIMEOUT) as client,
        pytest.raises(ValueError, match="session_id"),
    ):
        client.generate("hi", session_id="caf\u00e9")
    assert threaded_fake.servicer.requests == []


# -- the asyncio client ------------------------------------------------------------------------


async def test_async_sessions_reach_their_address_and_fall_back(
    start_fake_server: StartFake, dead_address: str
) -> None:
    servers = {s.address: s for s in [await start_fake_server(name) for name in "ab"]}
    addresses = [*servers, dead_address]
    async with AsyncClient(addresses, timeout=TIMEOUT) as client:
        for address in addresses:
            session = session_homed_at(address, addresses)
            for _ in range(3):
                result = await client.generate_text("hi", session_id=session)
                assert result.text == "Hello hi"
            if address in servers:
                sent = [m[SESSION_KEY] for m in servers[address].servicer.metadata]
                assert sent == [session] * 3
                servers[address].servicer.metadata.clear()
        # the dead address's session went to its next choice, one of the live ones
        down = session_homed_at(dead_address, addresses)
        fallback = rendezvous_order(down, addresses)[1]
        assert [m[SESSION_KEY] for m in servers[fallback].servicer.metadata] == [down] * 3
        info = await asyncio.wait_for(client.model_info(), TIMEOUT)  # no session: balanced
        assert info.model in ("a", "b")


# -- the command line --------------------------------------------------------------------------


def test_session_id_flag_sends_the_metadata(
    threaded_fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--timeout", str(TIMEOUT), "-a", threaded_fake.address, "--session-id", "c1", "x"])
    assert code == 0
    assert threaded_fake.servicer.metadata[0][SESSION_KEY] == "c1"
    capsys.readouterr()


def test_bad_session_id_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--session-id", "two words", "x"]) == 2
    assert "INVALID_ARGUMENT: session_id must be" in capsys.readouterr().err


def test_each_chat_is_one_session(
    threaded_fake: FakeServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def chat(*flags: str) -> list[str]:
        threaded_fake.servicer.metadata.clear()
        monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n"))
        assert main(["chat", "-a", threaded_fake.address, "--timeout", str(TIMEOUT), *flags]) == 0
        capsys.readouterr()
        return [m.get(SESSION_KEY) for m in threaded_fake.servicer.metadata]

    once, again = chat(), chat()
    # model info, then one call per question, all in the chat's own session
    assert len(set(once)) == 1 and re.fullmatch(r"[0-9a-f]{32}", once[0]) and len(once) == 3
    assert len(set(again)) == 1 and again[0] != once[0]
    assert chat("--session-id", "mine") == ["mine"] * 3

"""The blocking Client against a fake server running in a background thread."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.client import Client, InvalidRequest, ServerUnavailable

if TYPE_CHECKING:
    from conftest import FakeServer, StartThreadedFake

TIMEOUT = 10.0  # every call carries this deadline, so no test can hang on a stream


def test_generate_streams_rounds(threaded_fake: FakeServer) -> None:
    with Client(threaded_fake.address, timeout=TIMEOUT) as client:
        rounds = list(client.generate("world"))

    assert [r.text for r in rounds] == ["Hel", "lo", " world"]
    assert [r.finish_reason for r in rounds] == [None, None, "length"]


def test_generate_text_and_request_mapping(threaded_fake: FakeServer) -> None:
    with Client(threaded_fake.address, timeout=TIMEOUT) as client:
        completion = client.generate_text(
            "world", temperature=0.5, stop="\n\n", speculation="off", seed=9, max_new_tokens=3
        )

    assert completion.text == "Hello world"
    assert completion.usage.seed == 9
    (request,) = threaded_fake.servicer.requests
    assert isinstance(request, pb.GenerateRequest)
    assert request.sampling.temperature == pytest.approx(0.5)
    assert list(request.stopping.stop) == ["\n\n"]  # a lone string is one stop text
    assert request.stopping.max_new_tokens == 3
    assert request.speculation.mode == pb.SPECULATION_MODE_OFF
    assert not request.speculation.HasField("adaptive")
    assert request.speculation.draft_context == pb.DRAFT_CONTEXT_UNSPECIFIED


def test_token_defaults_to_env_read_at_construction(
    threaded_fake: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KENSPEC_TOKEN", "from-env")
    client = Client(threaded_fake.address, timeout=TIMEOUT)
    monkeypatch.setenv("KENSPEC_TOKEN", "too-late")
    with client:
        client.model_info()
    with Client(threaded_fake.address, token="", timeout=TIMEOUT) as no_token:
        no_token.model_info()

    first, second = threaded_fake.servicer.metadata
    assert first["authorization"] == "Bearer from-env"
    assert "authorization" not in second


def test_tokenize_chat(threaded_fake: FakeServer) -> None:
    with Client(threaded_fake.address, timeout=TIMEOUT) as client:
        response = client.tokenize(messages=[("user", "hey")])

    assert response.token_count == 3
    (request,) = threaded_fake.servicer.requests
    assert request.WhichOneof("input") == "messages"


def test_invalid_argument_is_translated(threaded_fake: FakeServer) -> None:
    with (
        Client(threaded_fake.address, timeout=TIMEOUT) as client,
        pytest.raises(InvalidRequest) as caught,
    ):
        list(client.generate("__invalid__"))

    assert caught.value.message == threaded_fake.servicer.INVALID_MESSAGE


def test_unreachable_server_fails_fast(dead_address: str) -> None:
    started = time.monotonic()
    with (
        Client(dead_address, timeout=TIMEOUT) as client,
        pytest.raises(ServerUnavailable) as caught,
    ):
        client.generate_text("hi")

    assert time.monotonic() - started < 5
    assert "cannot reach the kenspec server at " + dead_address in str(caught.value)


def test_round_robin_reaches_every_server(start_threaded_fake: StartThreadedFake) -> None:
    servers = [start_threaded_fake("a"), start_threaded_fake("b")]
    seen = set()
    with Client(",".join(s.address for s in servers), timeout=TIMEOUT) as client:
        for _ in range(20):
            seen.add(client.model_info().model)
            if seen == {"a", "b"}:
                break

    assert seen == {"a", "b"}

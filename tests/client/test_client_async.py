"""AsyncClient against the in-process fake server."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.client import (
    AsyncClient,
    Completion,
    DeadlineExceeded,
    InvalidRequest,
    ProtocolError,
    Round,
    ServerUnavailable,
)

if TYPE_CHECKING:
    from conftest import FakeServer, StartFake

TIMEOUT = 10.0  # seconds any single test await may take


async def collect(client: AsyncClient, *args: object, **kwargs: object) -> list[Round]:
    async def gather() -> list[Round]:
        return [r async for r in client.generate(*args, **kwargs)]  # type: ignore[arg-type]

    return await asyncio.wait_for(gather(), TIMEOUT)


async def test_generate_streams_rounds_in_order(fake: FakeServer) -> None:
    async with AsyncClient(fake.address) as client:
        rounds = await collect(client, "world")

    assert [r.text for r in rounds] == ["Hel", "lo", " world"]
    assert [r.index for r in rounds] == [0, 1, 2]
    assert [r.mode for r in rounds] == ["speculative", "autoregressive", "speculative"]
    assert rounds[1].breaker_state == "open"
    assert rounds[0].token_ids == (1, 2, 3, 4)
    assert (rounds[0].drafted, rounds[0].accepted) == (4, 3)
    assert [r.finish_reason for r in rounds] == [None, None, "length"]
    assert rounds[0].usage is None
    assert rounds[2].usage is not None and rounds[2].usage.completion_tokens == 7
    assert isinstance(rounds[2].response, pb.GenerateResponse)


async def test_generate_text_joins_rounds(fake: FakeServer) -> None:
    async with AsyncClient(fake.address) as client:
        completion = await asyncio.wait_for(
            client.generate_text("world", request_id="r-7", seed=5), TIMEOUT
        )

    assert isinstance(completion, Completion)
    assert completion.text == "Hello world"
    assert completion.token_ids == (1, 2, 3, 4, 5, 6, 7)
    assert completion.finish_reason == "length"
    assert completion.request_id == "r-7"
    assert completion.usage.seed == 5
    assert completion.usage.acceptance == pytest.approx(4 / 6)
    assert len(completion.rounds) == 3


async def test_request_fields_reach_the_server(fake: FakeServer) -> None:
    async with AsyncClient(fake.address) as client:
        await collect(
            client,
            "hi",
            temperature=0.7,
            top_k=40,
            top_p=0.9,
            seed=123,
            max_new_tokens=64,
            stop=["\n", "END"],
            ignore_eos=True,
            speculation="off",
            num_draft_tokens=6,
            adaptive=False,
            draft_context=True,
            request_id="abc",
        )

    (request,) = fake.servicer.requests
    assert isinstance(request, pb.GenerateRequest)
    assert request.prompt == "hi"
    assert request.request_id == "abc"
    assert request.sampling.temperature == pytest.approx(0.7)
    assert (request.sampling.top_k, request.sampling.seed) == (40, 123)
    assert request.sampling.top_p == pytest.approx(0.9)
    assert request.stopping.max_new_tokens == 64
    assert list(request.stopping.stop) == ["\n", "END"]
    assert request.stopping.ignore_eos
    assert request.speculation.mode == pb.SPECULATION_MODE_OFF
    assert request.speculation.num_draft_tokens == 6
    assert request.speculation.HasField("adaptive") and not request.speculation.adaptive
    assert request.speculation.draft_context == pb.DRAFT_CONTEXT_ON


async def test_chat_messages_are_sent_as_messages(fake: FakeServer) -> None:
    async with AsyncClient(fake.address) as client:
        rounds = await collect(
            client, messages=[("system", "be brief"), {"role": "user", "content": "ping"}]
        )

    (request,) = fake.servicer.requests
    assert request.WhichOneof("input") == "messages"
    turns = [(m.role, m.content) for m in request.messages.messages]
    assert turns == [("system", "be brief"), ("user", "ping")]
    assert rounds[-1].text == " ping"


async def test_bearer_token_is_sent_as_metadata(fake: FakeServer) -> None:
    async with AsyncClient(fake.address, token="s3cret") as client:
        await asyncio.wait_for(client.model_info(), TIMEOUT)

    assert fake.servicer.metadata[-1]["authorization"] == "Bearer s3cret"


async def test_tokenize_and_model_info(fake: FakeServer) -> None:
    async with AsyncClient(fake.address) as client:
        tokens = await asyncio.wait_for(client.tokenize("ab", return_tokens=True), TIMEOUT)
        info = await asyncio.wait_for(client.model_info(), TIMEOUT)

    assert list(tokens.token_ids) == [97, 98]
    assert list(tokens.tokens) == ["a", "b"]
    assert info.model == "fake"


async def test_invalid_argument_keeps_the_server_message(fake: FakeServer) -> None:
    async with AsyncClient(fake.address) as client:
        with pytest.raises(InvalidRequest) as caught:
            await collect(client, "__invalid__")

    assert caught.value.code_name == "INVALID_ARGUMENT"
    assert caught.value.message == fake.servicer.INVALID_MESSAGE
    assert str(caught.value) == f"INVALID_ARGUMENT: {fake.servicer.INVALID_MESSAGE}"


async def test_unreachable_server_fails_fast(dead_address: str) -> None:
    started = time.monotonic()
    async with AsyncClient(dead_address) as client:
        with pytest.raises(ServerUnavailable) as caught:
            await collect(client, "hi")

    assert time.monotonic() - started < 5
    assert caught.value.address == dead_address
    assert dead_address in caught.value.message


async def test_timeout_raises_deadline_exceeded(fake: FakeServer) -> None:
    async with AsyncClient(fake.address, timeout=0.2) as client:
        with pytest.raises(DeadlineExceeded):
            await collect(client, "__slow__")


async def test_stream_without_finish_is_a_protocol_error(fake: FakeServer) -> None:
    async with AsyncClient(fake.address) as client:
        with pytest.raises(ProtocolError):
            await asyncio.wait_for(client.generate_text("__no_finish__"), TIMEOUT)


async def test_leaving_the_stream_early_cancels_the_call(fake: FakeServer) -> None:
    async with AsyncClient(fake.address) as client:

        async def first_round() -> None:
            async for _ in client.generate("__endless__"):
                break

        await asyncio.wait_for(first_round(), TIMEOUT)
        await asyncio.wait_for(asyncio.to_thread(fake.servicer.cancelled.wait, TIMEOUT), TIMEOUT)

    assert fake.servicer.cancelled.is_set()


@pytest.mark.parametrize(
    ("prompt", "messages"),
    [(None, None), ("hi", [("user", "hi")]), (None, []), (None, [("user",)])],
)
async def test_bad_input_raises_value_error_before_sending(
    fake: FakeServer, prompt: str | None, messages: list[tuple[str, ...]] | None
) -> None:
    async with AsyncClient(fake.address) as client:
        with pytest.raises(ValueError):
            client.generate(prompt, messages)  # type: ignore[arg-type]

    assert fake.servicer.requests == []


async def test_round_robin_reaches_every_server(start_fake_server: StartFake) -> None:
    servers = [await start_fake_server("a"), await start_fake_server("b")]
    seen = set()
    async with AsyncClient([server.address for server in servers]) as client:
        for _ in range(20):
            seen.add((await asyncio.wait_for(client.model_info(), TIMEOUT)).model)
            if seen == {"a", "b"}:
                break

    assert seen == {"a", "b"}

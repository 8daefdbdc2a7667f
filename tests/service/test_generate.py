"""Generate over gRPC: rounds, usage, engine equality, concurrency, cancellation, limits."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kenspec_api import generator_pb2 as pb
from server.engine.generation import Generation
from tests.engine.drafts import reference_greedy

TIMEOUT = 60


async def collect(call, timeout: float = TIMEOUT) -> list[pb.GenerateResponse]:
    async def read():
        return [response async for response in call]

    return await asyncio.wait_for(read(), timeout)


def prompt_request(prompt: str = "The quick brown fox", **stopping) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, stopping=pb.StoppingCriteria(**stopping))


async def test_stream_rounds_and_usage_equal_the_engine_output(start_server, tiny_target) -> None:
    _, stub = await start_server()
    responses = await collect(stub.Generate(prompt_request(max_new_tokens=24)))
    ids = tiny_target.encode_prompt("The quick brown fox")
    expected = reference_greedy(tiny_target, ids, 24)
    token_ids = [t for r in responses for t in r.token_ids]
    assert token_ids == expected
    assert "".join(r.text for r in responses) == tiny_target.tokenizer.decode(expected)
    assert [r.round.index for r in responses] == list(range(len(responses)))
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert all(not r.HasField("usage") for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(ids)
    assert last.usage.completion_tokens == 24
    assert last.usage.rounds == len(responses)
    assert last.usage.drafted_tokens == sum(r.round.drafted for r in responses)
    assert last.usage.accepted_tokens == sum(r.round.accepted for r in responses) > 0
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id
    assert all(r.round.mode != pb.ROUND_MODE_UNSPECIFIED for r in responses)


async def test_chat_messages_request_id_and_speculation_off(start_server, tiny_target) -> None:
    _, stub = await start_server()
    request = pb.GenerateRequest(
        request_id="my-id",
        messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="Hello world")]),
        stopping=pb.StoppingCriteria(max_new_tokens=12),
        speculation=pb.SpeculationParameters(mode=pb.SPECULATION_MODE_OFF),
    )
    responses = await collect(stub.Generate(request))
    ids = tiny_target.encode_chat([{"role": "user", "content": "Hello world"}])
    assert [t for r in responses for t in r.token_ids] == reference_greedy(tiny_target, ids, 12)
    assert all(r.round.mode == pb.ROUND_MODE_AUTOREGRESSIVE for r in responses)
    assert all(r.request_id == "my-id" for r in responses)
    assert responses[-1].usage.drafted_tokens == 0


async def test_sampling_with_seed_is_reproducible_and_reports_the_seed(start_server) -> None:
    _, stub = await start_server()
    request = prompt_request(max_new_tokens=16)
    request.sampling.CopyFrom(pb.SamplingParameters(temperature=0.9, top_p=0.9, seed=42))
    first = await collect(stub.Generate(request))
    second = await collect(stub.Generate(request))
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert first[-1].usage.seed == 42
    request.sampling.ClearField("seed")
    unseeded = await collect(stub.Generate(request))
    assert unseeded[-1].usage.seed != 0


async def test_concurrent_streams_complete_and_interleave(start_server, tiny_target) -> None:
    _, stub = await start_server(max_concurrent_streams=4)
    prompts = ["The quick brown fox", "Hello world", "one pass", "over the"]
    arrivals: list[int] = []

    async def run(index: int, prompt: str) -> list[int]:
        tokens = []
        request = prompt_request(prompt, max_new_tokens=40)
        request.speculation.mode = pb.SPECULATION_MODE_OFF  # one token a round: many rounds
        async for response in stub.Generate(request):
            arrivals.append(index)
            tokens.extend(response.token_ids)
        return tokens

    results = await asyncio.wait_for(
        asyncio.gather(*(run(i, p) for i, p in enumerate(prompts))), TIMEOUT
    )
    for prompt, tokens in zip(prompts, results, strict=True):
        assert tokens == reference_greedy(tiny_target, tiny_target.encode_prompt(prompt), 40)
    # Round-robin: every stream has rounds before the first stream to finish is done.
    first_done = min(max(i for i, who in enumerate(arrivals) if who == s) for s in range(4))
    assert set(arrivals[:first_done]) == {0, 1, 2, 3}


async def test_cancellation_frees_the_slot_and_stops_within_a_round(
    start_server, monkeypatch
) -> None:
    server, stub = await start_server()
    steps = {"count": 0}
    original = Generation.step

    def counting_step(self):
        steps["count"] += 1
        return original(self)

    monkeypatch.setattr(Generation, "step", counting_step)
    request = prompt_request(max_new_tokens=390)
    request.speculation.mode = pb.SPECULATION_MODE_OFF
    call = stub.Generate(request)
    received = 0
    async for _ in call:
        received += 1
        if received == 3:
            break
    call.cancel()
    await asyncio.sleep(0.5)
    assert server.scheduler.active == 0
    assert steps["count"] <= received + 2  # the round in flight at most, then nothing
    # The server keeps serving.
    responses = await collect(stub.Generate(prompt_request(max_new_tokens=4)))
    assert responses[-1].usage.completion_tokens == 4


async def test_deadline_exceeded(start_server) -> None:
    server, stub = await start_server()
    request = prompt_request(max_new_tokens=390)
    request.speculation.mode = pb.SPECULATION_MODE_OFF
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub.Generate(request, timeout=0.3))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.3)
    assert server.scheduler.active == 0


async def test_resource_exhausted_beyond_streams_and_queue(start_server) -> None:
    server, stub = await start_server(max_concurrent_streams=1, max_queue=1)
    request = prompt_request(max_new_tokens=390)
    request.speculation.mode = pb.SPECULATION_MODE_OFF
    running = stub.Generate(request)
    await asyncio.wait_for(running.read(), TIMEOUT)  # holds the only slot
    queued = stub.Generate(prompt_request(max_new_tokens=2))
    await asyncio.sleep(0.2)
    assert server.scheduler.waiting == 1
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub.Generate(prompt_request(max_new_tokens=2)))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry later" in error.value.details()
    running.cancel()
    responses = await collect(queued)  # the queued stream gets the slot once it is free
    assert responses[-1].usage.completion_tokens == 2


async def test_tokenize_and_model_info(start_server, tiny_target) -> None:
    _, stub = await start_server()
    response = await stub.Tokenize(pb.TokenizeRequest(prompt="Hello world", return_tokens=True))
    assert list(response.token_ids) == tiny_target.encode_prompt("Hello world")
    assert response.token_count == len(response.token_ids) == len(response.tokens)
    chat = await stub.Tokenize(
        pb.TokenizeRequest(
            messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="hi")])
        )
    )
    assert list(chat.token_ids) == tiny_target.encode_chat([{"role": "user", "content": "hi"}])
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.vocab_size == tiny_target.vocab_size
    assert info.draft_order == 3 and info.draft.endswith("tiny.arpa")
    assert info.device == "cpu" and info.dtype == "float32"
    assert info.max_context_tokens == 512 and info.max_new_tokens_limit == 400
    assert info.breaker.window_rounds == 8
    assert info.breaker.fault_breaker_state == pb.BREAKER_STATE_CLOSED


@pytest.mark.parametrize("context", [pb.DRAFT_CONTEXT_ON, pb.DRAFT_CONTEXT_OFF])
async def test_per_request_draft_context_is_lossless(start_server, tiny_target, context) -> None:
    _, stub = await start_server()
    prompt = "dog fox dog fox dog fox dog"  # a repetitive prompt the context draft can copy from
    request = prompt_request(prompt, max_new_tokens=20)
    request.speculation.draft_context = context
    responses = await collect(stub.Generate(request))
    expected = reference_greedy(tiny_target, tiny_target.encode_prompt(prompt), 20)
    assert [t for r in responses for t in r.token_ids] == expected
    assert responses[-1].usage.drafted_tokens > 0

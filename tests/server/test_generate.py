"""Generate over gRPC: rounds, usage, engine equality, concurrency, cancellation, limits.

Streams that must not finish (cancelled, past a deadline, holding a slot) are held by the pass
gate (held_passes), not outrun by the clock: the verdicts are the same on any machine.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.server.engine.batch import Batch
from tests.server.engine.drafts import reference_greedy

TIMEOUT = 60  # seconds; bounds waits that a passing run never reaches


async def test_stream_rounds_and_usage_equal_the_engine_output(
    start_server, tiny_target, collect, prompt_request
) -> None:
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


async def test_chat_messages_request_id_and_speculation_off(
    start_server, tiny_target, collect
) -> None:
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


async def test_sampling_with_seed_is_reproducible_and_reports_the_seed(
    start_server, collect, prompt_request
) -> None:
    _, stub = await start_server()
    request = prompt_request(max_new_tokens=16)
    request.sampling.CopyFrom(pb.SamplingParameters(temperature=0.9, top_p=0.9, seed=42))
    first = await collect(stub.Generate(request))
    second = await collect(stub.Generate(request))
    # The same tokens; not the same rounds: the second drafts from the first's learned answer.
    assert [t for r in first for t in r.token_ids] == [t for r in second for t in r.token_ids]
    assert first[-1].usage.seed == 42
    request.sampling.ClearField("seed")
    unseeded = await collect(stub.Generate(request))
    assert unseeded[-1].usage.seed != 0


async def test_concurrent_streams_complete_and_interleave(
    start_server, held_passes, tiny_target, prompt_request, monkeypatch
) -> None:
    _, stub = await start_server(max_concurrent_streams=4)
    prompts = ["The quick brown fox", "Hello world", "one pass", "over the"]
    # No pass runs before all four streams are in the batch: none can finish before the others
    # arrive, however fast the machine and however the requests are scheduled.
    all_added, added = asyncio.Event(), []
    original_add = Batch.add

    def counting_add(batch, generation, deliver, follows=None):  # type: ignore[no-untyped-def]
        queued = original_add(batch, generation, deliver, follows)
        added.append(generation)  # on the event loop's thread, like the test
        if len(added) == len(prompts):
            all_added.set()
        return queued

    monkeypatch.setattr(Batch, "add", counting_add)
    arrivals: list[int] = []

    async def run(index: int, prompt: str) -> list[int]:
        tokens = []
        request = prompt_request(prompt, max_new_tokens=40)
        request.speculation.mode = pb.SPECULATION_MODE_OFF  # one token a round: many rounds
        async for response in stub.Generate(request):
            arrivals.append(index)
            tokens.extend(response.token_ids)
        return tokens

    streams = asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    await asyncio.wait_for(all_added.wait(), TIMEOUT)
    held_passes.open()
    results = await asyncio.wait_for(streams, TIMEOUT)
    for prompt, tokens in zip(prompts, results, strict=True):
        assert tokens == reference_greedy(tiny_target, tiny_target.encode_prompt(prompt), 40)
    # Round-robin: every stream has rounds before the first stream to finish is done.
    first_done = min(max(i for i, who in enumerate(arrivals) if who == s) for s in range(4))
    assert set(arrivals[:first_done]) == {0, 1, 2, 3}
    # One batch: the streams were verified together, four rows a pass.
    assert max(len(p.rows) for p in held_passes.arrived) == 4


async def test_cancellation_frees_the_slot_and_stops_within_a_round(
    start_server, held_passes, tiny_target, prompt_request, collect, wait_until_idle
) -> None:
    server, stub = await start_server()
    request = prompt_request(max_new_tokens=390)
    request.speculation.mode = pb.SPECULATION_MODE_OFF
    held_passes.allow(3)
    call = stub.Generate(request)
    received = [await asyncio.wait_for(call.read(), TIMEOUT) for _ in range(3)]
    await held_passes.arrival(4)  # the next round's pass is in flight (held) when it leaves
    call.cancel()
    await wait_until_idle(server)
    assert server.scheduler.active == 0
    held_passes.open()
    # Behind the batch on the engine thread: runs once the batch has gone idle.
    passes = await server.scheduler.run(lambda: list(held_passes.arrived))
    assert len(passes) == len(received) + 1  # the round in flight at most, then nothing
    # Every pass was this stream's, through the batch, alone: the first fed the prompt's last
    # token (after what of the prompt was not cached), each later one the token just streamed.
    assert all(len(p.rows) == 1 for p in passes)
    prompt = tiny_target.encode_prompt("The quick brown fox")
    assert passes[0].rows[0][-1] == prompt[-1]
    assert passes[0].rows[0] == prompt[len(prompt) - 1 - passes[0].prompt_tails[0] :]
    streamed = [r.token_ids[-1] for r in received]
    assert [p.rows[0] for p in passes[1:]] == [[token] for token in streamed]
    # The server keeps serving.
    responses = await collect(stub.Generate(prompt_request(max_new_tokens=4)))
    assert responses[-1].usage.completion_tokens == 4


async def test_deadline_exceeded(
    start_server, held_passes, collect, prompt_request, wait_until_idle
) -> None:
    server, stub = await start_server()
    request = prompt_request(max_new_tokens=390)
    request.speculation.mode = pb.SPECULATION_MODE_OFF
    # No pass gets through: the stream cannot finish within its deadline on any machine.
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub.Generate(request, timeout=0.3))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until_idle(server)  # its slot comes free
    assert server.scheduler.active == 0


async def test_resource_exhausted_beyond_streams_and_queue(
    start_server, held_passes, collect, prompt_request
) -> None:
    server, stub = await start_server(max_concurrent_streams=1, max_queue=1)
    request = prompt_request(max_new_tokens=390)
    request.speculation.mode = pb.SPECULATION_MODE_OFF
    held_passes.allow(1)
    running = stub.Generate(request)
    await asyncio.wait_for(running.read(), TIMEOUT)  # holds the only slot; its next pass waits
    # Two more: whichever comes second finds the slot taken and the queue full.
    calls = [
        asyncio.ensure_future(collect(stub.Generate(prompt_request(max_new_tokens=2))))
        for _ in range(2)
    ]
    done, pending = await asyncio.wait(calls, timeout=TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and len(pending) == 1
    (refused,), (queued,) = done, pending
    with pytest.raises(grpc.aio.AioRpcError) as error:
        refused.result()
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry after" in error.value.details()
    assert server.scheduler.waiting == 1
    running.cancel()
    held_passes.open()
    responses = await queued  # the queued stream gets the slot once it is free
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
    assert info.device == "cpu" and info.dtype == "float32" and info.weights == "float32"
    assert info.execution_plan.startswith("eager; head lazy;")  # (the served float32 plan)
    assert info.max_context_tokens == 512 and info.max_new_tokens_limit == 400
    assert info.breaker.window_rounds == 8
    assert not info.breaker.judged_by_time  # (these servers: --breaker-threshold 0)
    assert info.breaker.fault_breaker_state == pb.BREAKER_STATE_CLOSED


@pytest.mark.parametrize("context", [pb.DRAFT_CONTEXT_ON, pb.DRAFT_CONTEXT_OFF])
async def test_per_request_draft_context_is_lossless(
    start_server, tiny_target, context, collect, prompt_request
) -> None:
    _, stub = await start_server()
    prompt = "dog fox dog fox dog fox dog"  # a repetitive prompt the context draft can copy from
    request = prompt_request(prompt, max_new_tokens=20)
    request.speculation.draft_context = context
    responses = await collect(stub.Generate(request))
    expected = reference_greedy(tiny_target, tiny_target.encode_prompt(prompt), 20)
    assert [t for r in responses for t in r.token_ids] == expected
    assert responses[-1].usage.drafted_tokens > 0

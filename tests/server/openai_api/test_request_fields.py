"""The request fields OpenAI clients send first, over both APIs with speculation on: logprobs
(chat and completions shapes), n choices, penalties and logit_bias, min_p."""

from __future__ import annotations

import math

import grpc
import openai
import pytest

from kenspec.api import generator_pb2 as pb
from tests.server.openai_api.test_openai_api import (
    MESSAGES,
    TIMEOUT,
    grpc_chat,
    model_id,
    sdk,
)

SAMPLED = {"temperature": 0.9, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


async def _grpc(stub, **request) -> list[pb.GenerateResponse]:  # type: ignore[no-untyped-def]
    request.setdefault("stopping", pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True))
    call = stub.Generate(pb.GenerateRequest(**request), timeout=TIMEOUT)
    return [response async for response in call]


async def test_grpc_logprobs_come_with_every_token(http_server) -> None:
    _, stub, _ = await http_server()
    responses = await _grpc(stub, prompt="The quick brown fox", logprobs=True, top_logprobs=3)
    for response in responses:
        assert len(response.logprobs) == len(response.token_ids)
        for token, logprob in zip(response.token_ids, response.logprobs, strict=True):
            assert logprob.token_id == token and logprob.logprob <= 0.0
            assert len(logprob.top_logprobs) == 3
            best = logprob.top_logprobs[0]
            assert best.logprob >= logprob.logprob - 1e-6  # greedy picks the best
            assert best.token_id == token
    plain = await _grpc(stub, prompt="The quick brown fox")
    assert all(not response.logprobs for response in plain)
    assert [t for r in plain for t in r.token_ids] == [t for r in responses for t in r.token_ids]


async def test_grpc_n_choices_are_single_requests_with_derived_seeds(http_server) -> None:
    _, stub, _ = await http_server()
    sampling = pb.SamplingParameters(temperature=0.9, seed=41)
    responses = await _grpc(stub, prompt="Once upon", sampling=sampling, n=3)
    by_choice: dict[int, list[pb.GenerateResponse]] = {}
    for response in responses:
        by_choice.setdefault(response.choice_index, []).append(response)
    assert sorted(by_choice) == [0, 1, 2]
    answers = []
    for choice, own in sorted(by_choice.items()):
        assert own[-1].HasField("usage") and own[-1].usage.seed == 41 + choice
        assert all(not r.HasField("usage") for r in own[:-1])
        single = await _grpc(
            stub,
            prompt="Once upon",
            sampling=pb.SamplingParameters(temperature=0.9, seed=41 + choice),
        )
        tokens = [t for r in own for t in r.token_ids]
        assert tokens == [t for r in single for t in r.token_ids]
        answers.append(tuple(tokens))
    assert len(set(answers)) > 1


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({"n": 100}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"sampling": pb.SamplingParameters(presence_penalty=math.nan)}, "presence_penalty"),
        ({"sampling": pb.SamplingParameters(frequency_penalty=9)}, "frequency_penalty"),
        ({"sampling": pb.SamplingParameters(min_p=2)}, "min_p"),
        ({"sampling": pb.SamplingParameters(logit_bias={10**6: 1.0})}, "logit_bias"),
        ({"sampling": pb.SamplingParameters(repetition_penalty=-1)}, "repetition_penalty"),
    ],
)
async def test_grpc_bad_fields_are_invalid_argument(http_server, request_fields, named) -> None:
    _, stub, _ = await http_server()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _grpc(stub, prompt="Hi", **request_fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in error.value.details()


async def test_chat_logprobs_as_openai_returns_them(http_server) -> None:
    server, stub, url = await http_server()
    grpc_responses = await _grpc(stub, messages=grpc_chat(MESSAGES), logprobs=True, top_logprobs=2)
    expected = [lp for r in grpc_responses for lp in r.logprobs]
    async with sdk(url) as client:
        whole = await client.chat.completions.create(
            model=model_id(server),
            messages=MESSAGES,
            temperature=0,
            max_tokens=12,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )
        stream = await client.chat.completions.create(
            model=model_id(server),
            messages=MESSAGES,
            temperature=0,
            max_tokens=12,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = [
            lp for chunk in [c async for c in stream] for lp in chunk.choices[0].logprobs.content
        ]
    content = whole.choices[0].logprobs.content
    assert len(content) == len(expected) == 12 == len(streamed)
    for mine, theirs, other in zip(content, expected, streamed, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-6)
        assert mine.token == theirs.token == other.token
        assert bytes(mine.bytes).decode("utf-8", "replace") == mine.token
        assert [t.token for t in mine.top_logprobs] == [t.token for t in theirs.top_logprobs]
    joined = b"".join(bytes(item.bytes) for item in content)
    assert joined.decode("utf-8", "replace") == whole.choices[0].message.content


async def test_completions_logprobs_in_the_legacy_shape(http_server) -> None:
    server, _, url = await http_server()
    async with sdk(url) as client:
        whole = await client.completions.create(
            model=model_id(server),
            prompt="The quick brown fox",
            logprobs=2,
            **SAMPLED | {"temperature": 0},
        )
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    assert all(len(top) <= 2 and top for top in logprobs.top_logprobs)
    pairs = zip(logprobs.text_offset, logprobs.tokens, strict=True)
    ends = [offset + len(token) for offset, token in pairs]
    assert logprobs.text_offset == [0, *ends[:-1]]


async def test_http_n_choices_streamed_and_whole(http_server) -> None:
    server, _, url = await http_server()
    async with sdk(url) as client:
        whole = await client.chat.completions.create(
            model=model_id(server), messages=MESSAGES, n=3, seed=5, **SAMPLED
        )
        stream = await client.chat.completions.create(
            model=model_id(server),
            messages=MESSAGES,
            n=3,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLED,
        )
        chunks = [chunk async for chunk in stream]
        singles = [
            await client.chat.completions.create(
                model=model_id(server), messages=MESSAGES, seed=5 + i, **SAMPLED
            )
            for i in range(3)
        ]
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    texts = [choice.message.content for choice in whole.choices]
    assert texts == [single.choices[0].message.content for single in singles]
    assert whole.usage.completion_tokens == 36
    assert whole.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert whole.model_extra["kenspec"]["seeds"] == [5, 6, 7]
    *rounds, usage = chunks
    streamed = {
        i: "".join(c.choices[0].delta.content for c in rounds if c.choices[0].index == i)
        for i in range(3)
    }
    assert [streamed[i] for i in range(3)] == texts
    firsts = [next(c for c in rounds if c.choices[0].index == i) for i in range(3)]
    assert all(c.choices[0].delta.role == "assistant" for c in firsts)
    assert usage.usage.completion_tokens == 36


async def test_penalties_and_bias_change_the_answer_and_stay_exact(http_server) -> None:
    """Greedy with speculation on equals greedy with it off, under the same processors, and
    the processors do change the answer."""
    server, _, url = await http_server()
    fields = {
        "presence_penalty": 1.0,
        "frequency_penalty": 1.5,
        "logit_bias": {"5": 3.0},
        "temperature": 0,
        "max_tokens": 24,
    }
    async with sdk(url) as client:

        async def answer(speculation: str, **extra) -> str:  # type: ignore[no-untyped-def]
            body = {"ignore_eos": True, "speculation": speculation, **extra.pop("extra_body", {})}
            response = await client.chat.completions.create(
                model=model_id(server), messages=MESSAGES, extra_body=body, **extra
            )
            return response.choices[0].message.content

        on = await answer("auto", **fields)
        off = await answer("off", **fields)
        plain = await answer("auto", temperature=0, max_tokens=24)
        repetition = await answer(
            "auto", temperature=0, max_tokens=24, extra_body={"repetition_penalty": 1.5}
        )
        repetition_off = await answer(
            "off", temperature=0, max_tokens=24, extra_body={"repetition_penalty": 1.5}
        )
    assert on == off and on != plain
    assert repetition == repetition_off and repetition != plain


async def test_min_p_is_served(http_server) -> None:
    server, _, url = await http_server()
    async with sdk(url) as client:
        response = await client.completions.create(
            model=model_id(server),
            prompt="Hello",
            extra_body={"min_p": 0.2, "ignore_eos": True},
            temperature=1.0,
            max_tokens=8,
        )
    assert response.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError):
        async with sdk(url) as client:
            await client.completions.create(model=model_id(server), prompt="Hello", echo=True)


async def test_the_bundled_client_joins_choices_and_logprobs(http_server) -> None:
    from kenspec.client import AsyncClient

    server, _, _ = await http_server()
    async with AsyncClient(f"127.0.0.1:{server.port}", timeout=TIMEOUT) as client:
        choices = await client.generate_choices(
            "Once upon", n=2, temperature=0.9, seed=3, max_new_tokens=8, ignore_eos=True
        )
        single = await client.generate_text(
            "Once upon", temperature=0.9, seed=4, max_new_tokens=8, logprobs=True, top_logprobs=2
        )
        with pytest.raises(ValueError, match="generate_choices"):
            await client.generate_text("Once upon", n=2)
    assert [c.choice_index for c in choices] == [0, 1]
    assert [c.usage.seed for c in choices] == [3, 4]
    assert choices[1].token_ids == single.token_ids  # choice 1 is seed 3 + 1
    assert [lp.token_id for lp in single.logprobs] == list(single.token_ids)
    assert all(len(lp.top) <= 2 and lp.logprob <= 0 for lp in single.logprobs)

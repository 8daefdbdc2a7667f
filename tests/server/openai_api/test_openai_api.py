"""The OpenAI-compatible HTTP API, driven by clients nobody here wrote: the official `openai`
package (chat and completions, streamed and not) and httpx for the SSE framing and the
refusals. Greedy output must equal the gRPC API's for the same request (float32)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kenspec.api import generator_pb2 as pb

TIMEOUT = 60.0  # seconds; bounds waits that a passing run never reaches
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]
GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


def model_id(server) -> str:
    return Path(server.settings.model.model).name


def sdk(base_url: str, api_key: str = "unused", **options) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT, **options
    )


async def grpc_text(stub, **request) -> tuple[str, pb.GenerateResponse]:
    request.setdefault("stopping", pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))
    responses = [r async for r in stub.Generate(pb.GenerateRequest(**request), timeout=TIMEOUT)]
    return "".join(r.text for r in responses), responses[-1]


def grpc_chat(messages) -> pb.Messages:
    return pb.Messages(messages=[pb.ChatMessage(**m) for m in messages])


async def test_chat_greedy_matches_grpc_streamed_and_not(http_server) -> None:
    server, stub, url = await http_server()
    expected, last = await grpc_text(stub, messages=grpc_chat(MESSAGES))
    async with sdk(url) as client:
        whole = await client.chat.completions.create(
            model=model_id(server), messages=MESSAGES, **GREEDY
        )
        stream = await client.chat.completions.create(
            model=model_id(server),
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        chunks = [chunk async for chunk in stream]
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == last.usage.prompt_tokens
    assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    statistics = whole.model_extra["kenspec"]
    assert statistics["rounds"] >= 1 and statistics["accepted"] <= statistics["drafted"]
    assert statistics["mode"] in ("speculative", "autoregressive")
    # One event per verification round, then the usage chunk (no choices).
    *rounds, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 24
    assert [c.model_extra["kenspec"]["round"] for c in rounds] == list(range(len(rounds)))
    assert len(rounds) == usage.model_extra["kenspec"]["rounds"]
    assert rounds[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in rounds) == expected
    assert [c.choices[0].finish_reason for c in rounds][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in rounds[:-1])


async def test_completions_greedy_matches_grpc_streamed_and_not(http_server) -> None:
    server, stub, url = await http_server()
    prompt = "The quick brown fox"
    expected, _ = await grpc_text(stub, prompt=prompt)
    async with sdk(url) as client:
        whole = await client.completions.create(model=model_id(server), prompt=prompt, **GREEDY)
        stream = await client.completions.create(
            model=model_id(server), prompt=prompt, stream=True, **GREEDY
        )
        chunks = [chunk async for chunk in stream]
    assert whole.object == "text_completion"
    assert whole.choices[0].text == expected
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].usage is None  # no include_usage: no usage chunk


async def test_sse_framing(http_server) -> None:
    server, _, url = await http_server()
    body = {"model": model_id(server), "prompt": "Hello", "max_tokens": 5, "stream": True}
    async with (
        httpx.AsyncClient(timeout=TIMEOUT) as client,
        client.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"]
        raw = (await response.aread()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert sum(len(chunk["choices"][0]["text"]) > 0 for chunk in chunks) >= 1
    assert all(chunk["id"] == "cmpl-" + response.headers["x-request-id"] for chunk in chunks)


async def test_models_and_unknown_model(http_server) -> None:
    server, _, url = await http_server()
    async with sdk(url) as client:
        listed = await client.models.list()
        assert [m.id for m in listed.data] == [model_id(server)]
        assert (await client.models.retrieve(model_id(server))).id == model_id(server)
        with pytest.raises(openai.NotFoundError) as error:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert "gpt-4o" in error.value.message and model_id(server) in error.value.message
    assert error.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),  # more choices than the server's concurrent streams
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),  # chat's logprobs is a boolean
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "a"}, "frequency_penalty"),
        ({"logit_bias": {"x1": 3}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # not in the vocabulary
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
        ({"temperature": 3}, "temperature"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"stop": ["a"] * 65}, "stop"),
        ({"extra_body": {"speculation": "always"}}, "speculation"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content[0]"),
        ({"messages": [{"role": "function", "content": "x"}]}, "role"),
        ({"messages": []}, "messages"),
    ],
)
async def test_unsupported_or_bad_fields_are_400_naming_the_field(
    http_server, fields, named
) -> None:
    server, _, url = await http_server()
    request = {"model": model_id(server), "messages": MESSAGES, "max_tokens": 3, **fields}
    async with sdk(url) as client:
        with pytest.raises(openai.BadRequestError) as error:
            await client.chat.completions.create(**request)
        assert named in error.value.message
        assert error.value.body["type"] == "invalid_request_error"
        assert "Traceback" not in error.value.message
        served = await client.chat.completions.create(
            model=model_id(server), messages=MESSAGES, max_tokens=3
        )
    assert served.usage.completion_tokens <= 3


async def test_bad_json_oversized_body_and_unknown_route(http_server) -> None:
    server, _, url = await http_server(max_message_bytes=4096)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        json_type = {"content-type": "application/json"}
        bad = await client.post("/v1/chat/completions", content=b"{not json", headers=json_type)
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        array = await client.post("/v1/completions", json=[1, 2])
        assert array.status_code == 400 and "JSON object" in array.json()["error"]["message"]
        huge = {"model": model_id(server), "prompt": "x" * 10_000}
        too_large = await client.post("/v1/completions", json=huge)
        assert too_large.status_code == 413 and "4096" in too_large.json()["error"]["message"]
        missing = await client.get("/v1/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        wrong_method = await client.get("/v1/completions")
        assert wrong_method.status_code == 405
        bad_id = await client.post(
            "/v1/completions",
            json={"model": model_id(server), "prompt": "x"},
            headers={"x-request-id": "two\tlines"},
        )
        assert bad_id.status_code == 400 and "x-request-id" in bad_id.json()["error"]["message"]
        fine = await client.post(
            "/v1/completions", json={"model": model_id(server), "prompt": "Hi", "max_tokens": 2}
        )
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] <= 2
    count = server.metrics.registry.get_sample_value
    labels = {"api": "http", "finish_reason": "none", "code": "INVALID_ARGUMENT"}
    labels["model_name"] = server.metrics.model_name
    assert count("kenspec_requests_total", labels) == 3  # the bad JSON, the array, the id


@pytest.mark.parametrize("streamed", [True, False])
async def test_disconnect_cancels_the_generation(
    http_server, held_passes, wait_until_idle, streamed
) -> None:
    server, _, url = await http_server()
    body = {"model": model_id(server), "prompt": "Hello", "max_tokens": 300, "stream": streamed}
    body["ignore_eos"] = True
    held_passes.allow(1)  # the prefill and first round; every later pass waits at the gate

    async def read_then_leave() -> None:
        async with (
            httpx.AsyncClient(timeout=TIMEOUT) as client,
            client.stream("POST", url + "/v1/completions", json=body) as response,
        ):
            if streamed:
                await anext(response.aiter_lines())  # the first round arrived
            # leaving the block closes the connection mid-generation

    if streamed:
        await asyncio.wait_for(read_then_leave(), TIMEOUT)
    else:  # no byte comes before the end: leave once the generation holds its pass
        leaving = asyncio.ensure_future(read_then_leave())
        await held_passes.arrival(2)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
    # The passes are still held: only a cancelled generation gives its slot back.
    await wait_until_idle(server)
    labels = {"api": "http", "finish_reason": "none", "code": "CANCELLED"}
    labels["model_name"] = server.metrics.model_name
    count = server.metrics.registry.get_sample_value
    for _ in range(100):  # the record closes as the cancelled response unwinds
        if count("kenspec_requests_total", labels) == 1:
            break
        await asyncio.sleep(0.05)
    assert count("kenspec_requests_total", labels) == 1


async def test_full_queue_is_429_with_retry_after(http_server, held_passes) -> None:
    server, _, url = await http_server(max_concurrent_streams=1, max_queue=0)
    body = {"model": model_id(server), "prompt": "Hello", "max_tokens": 50, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        holding = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await held_passes.arrival(1)  # the first request holds the only slot
        refused = await client.post("/v1/completions", json=body)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        held_passes.open()
        assert (await asyncio.wait_for(holding, TIMEOUT)).status_code == 200


async def test_deadline_cap_while_queued_is_504(http_server, held_passes) -> None:
    server, _, url = await http_server(max_concurrent_streams=1, max_deadline_s=0.3)
    body = {"model": model_id(server), "prompt": "Hello", "max_tokens": 50, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        holding = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await held_passes.arrival(1)
        queued = await client.post("/v1/completions", json=body)
        assert queued.status_code == 504 and "0.3 s" in queued.json()["error"]["message"]
        held_passes.open()
        await asyncio.wait_for(holding, TIMEOUT)


async def test_bearer_tokens_as_on_grpc(http_server, tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alpha-token\n")
    server, _, url = await http_server(auth_tokens_file=str(tokens))
    request = {"model": model_id(server), "messages": MESSAGES, "max_tokens": 2}
    async with sdk(url, api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(**request)
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        missing = await client.post("/v1/chat/completions", json=request)
        assert missing.status_code == 401 and "Bearer" in missing.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200  # probes carry no token
    async with sdk(url, api_key="alpha-token") as client:
        answer = await client.chat.completions.create(**request)
    assert answer.usage.completion_tokens <= 2


async def test_https_and_mutual_tls_as_on_grpc(http_server, pki) -> None:
    server, _, url = await http_server(
        tls_cert=str(pki["server_cert"]),
        tls_key=str(pki["server_key"]),
        tls_client_ca=str(pki["ca"]),
    )
    request = {"model": model_id(server), "prompt": "Hi", "max_tokens": 2}
    certificate = (str(pki["client_cert"]), str(pki["client_key"]))
    async with httpx.AsyncClient(verify=_context(pki, certificate), timeout=TIMEOUT) as client:
        answer = await client.post(url + "/v1/completions", json=request)
    assert answer.status_code == 200
    async with httpx.AsyncClient(verify=_context(pki, None), timeout=TIMEOUT) as anonymous:
        with pytest.raises((httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError)):
            await anonymous.post(url + "/v1/completions", json=request)
    plain = url.replace("https://", "http://")
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError)):
            await client.post(plain + "/v1/completions", json=request)


def _context(pki, certificate):
    import ssl

    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if certificate:
        context.load_cert_chain(*certificate)
    return context


async def test_health_agrees_with_grpc_health(http_server) -> None:
    server, _, url = await http_server(load=False)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)

    async def both() -> tuple[int, int]:
        grpc_status = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            http_status = (await client.get(url + "/health")).status_code
        return grpc_status.status, http_status

    try:
        assert await both() == (health_pb2.HealthCheckResponse.NOT_SERVING, 503)
        await server.load()
        assert await both() == (health_pb2.HealthCheckResponse.SERVING, 200)
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            body = {"model": model_id(server), "prompt": "Hi", "max_tokens": 2}
            server.serving.draining = True
            refused = await client.post(url + "/v1/completions", json=body)
            assert refused.status_code == 503 and "shutting down" in refused.text
            assert (await client.get(url + "/health")).status_code == 503
    finally:
        await channel.close()


async def test_metrics_label_requests_by_api(http_server) -> None:
    server, stub, url = await http_server()
    await grpc_text(stub, prompt="Hi", stopping=pb.StoppingCriteria(max_new_tokens=2))
    async with sdk(url) as client:
        await client.completions.create(
            model=model_id(server), prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True}
        )
    count = server.metrics.registry.get_sample_value
    for api in ("grpc", "http"):
        labels = {"api": api, "finish_reason": "length", "code": "OK"}
        labels["model_name"] = server.metrics.model_name
        assert count("kenspec_requests_total", labels) == 1, api


async def test_speculation_knobs_reach_the_engine(http_server) -> None:
    server, _, url = await http_server()
    async with sdk(url) as client:
        off = await client.completions.create(
            model=model_id(server),
            prompt="The quick brown fox",
            max_tokens=12,
            temperature=0,
            extra_body={"speculation": "off", "ignore_eos": True},
        )
    assert off.model_extra["kenspec"]["drafted"] == 0
    assert off.model_extra["kenspec"]["rounds"] == 12
    assert off.model_extra["kenspec"]["mode"] == "autoregressive"


def test_official_client_streams_from_a_server_process(tiny_server) -> None:
    """As the README shows it: `kenspec serve` with its HTTP API on, the official client's
    streaming chat, then SIGTERM drains both APIs and the process exits 0."""
    process = tiny_server("--port", "0")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{process.http_port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT,
    )
    (model,) = [card.id for card in client.models.list()]
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text and process.logged("http_listening") is not None
    client.close()
    process.stop()
    assert process.process.returncode == 0
    process.wait_for("stopped", TIMEOUT)  # drained, not killed

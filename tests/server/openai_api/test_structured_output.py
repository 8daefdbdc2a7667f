"""response_format over HTTP (chat and completions) and gRPC: valid output, the same tokens
as speculation off, and a 400 / INVALID_ARGUMENT naming why for a grammar that cannot be."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import openai
import pytest

from kenspec.api import generator_pb2 as pb
from tests.server.engine.test_grammar import SCHEMA
from tests.server.openai_api.test_openai_api import MESSAGES, TIMEOUT, grpc_chat, model_id, sdk

FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}


@pytest.fixture
async def http_server(start_server):
    server, stub = await start_server(port=0)
    return server, stub, f"http://localhost:{server.http_port}"


async def test_chat_json_schema_is_valid_and_the_same_with_speculation_off(http_server) -> None:
    server, stub, url = http_server
    request = {"model": model_id(server), "messages": MESSAGES, "temperature": 0}
    async with sdk(url) as client:
        on = await client.chat.completions.create(**request, max_tokens=64, response_format=FORMAT)
        off = await client.chat.completions.create(
            **request, max_tokens=64, response_format=FORMAT, extra_body={"speculation": "off"}
        )
        cut = await client.chat.completions.create(**request, max_tokens=3, response_format=FORMAT)
    assert on.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(on.choices[0].message.content), SCHEMA)
    assert on.choices[0].message.content == off.choices[0].message.content
    assert cut.choices[0].finish_reason == "length"  # cut short: said so, not passed as whole
    responses = [
        response
        async for response in stub.Generate(
            pb.GenerateRequest(
                messages=grpc_chat(MESSAGES),
                stopping=pb.StoppingCriteria(max_new_tokens=64),
                response_format=pb.ResponseFormat(json_schema=json.dumps(SCHEMA)),
            ),
            timeout=TIMEOUT,
        )
    ]
    assert "".join(r.text for r in responses) == on.choices[0].message.content


async def test_completions_take_json_object_and_kenspecs_regex(http_server) -> None:
    server, _, url = http_server
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        request = {"model": model_id(server), "prompt": "A colour:", "temperature": 0}
        json_object = await client.post(
            "/v1/completions",
            json={**request, "max_tokens": 64, "response_format": {"type": "json_object"}},
        )
        regex = await client.post(
            "/v1/completions",
            json={**request, "response_format": {"type": "regex", "regex": "(red|blue)!"}},
        )
    choice = json_object.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["finish_reason"] == "length" and choice["text"].startswith("{")
    assert regex.json()["choices"][0]["text"] in ("red!", "blue!")


@pytest.mark.parametrize(
    ("response_format", "extra", "named"),
    [
        ({"type": "json_schema", "json_schema": {"schema": {"uniqueItems": True}}}, {}, "unique"),
        ({"type": "regex", "regex": "a(b"}, {}, "unclosed group"),
        ({"type": "json_schema"}, {}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": 3}}, {}, "schema"),
        ({"type": "xml"}, {}, "response_format"),
        ({"type": "json_object", "schema": {}}, {}, "response_format.schema"),
        ({"type": "json_object"}, {"stop": ["}"]}, "stop"),
        ({"type": "json_object"}, {"extra_body": {"ignore_eos": True}}, "ignore_eos"),
    ],
)
async def test_a_grammar_that_cannot_be_served_is_400_naming_why(
    http_server, response_format, extra, named
) -> None:
    server, _, url = http_server
    async with sdk(url) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(
                    model=model_id(server),
                    messages=MESSAGES,
                    max_tokens=8,
                    response_format=response_format,
                    stream=stream,
                    **extra,
                )
            assert named.lower() in error.value.message.lower(), error.value.message
            assert "Traceback" not in error.value.message


async def test_grpc_refuses_a_schema_it_cannot_compile_naming_the_keyword(http_server) -> None:
    _, stub, _ = http_server
    schema = json.dumps({"type": "array", "uniqueItems": True})
    call = stub.Generate(
        pb.GenerateRequest(prompt="x", response_format=pb.ResponseFormat(json_schema=schema)),
        timeout=TIMEOUT,
    )
    with pytest.raises(grpc.aio.AioRpcError) as error:
        [response async for response in call]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "uniqueItems" in error.value.details()

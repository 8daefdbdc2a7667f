"""Tool calls over the OpenAI API, driven by the official client, and over gRPC: a forced call
is valid for its schema, streamed as OpenAI streams calls, the same with speculation off and
over gRPC; the tool loop (call, result, answer) runs; bad tools and messages are a 400 (or
INVALID_ARGUMENT) naming the field."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.client import AsyncClient
from kenspec.server.runtime import load_runtime
from tests import tiny
from tests.server.openai_api.test_openai_api import TIMEOUT, model_id, sdk

# Schemas whose calls are bounded: a random model writes strings until its limit otherwise.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def tool_settings(base_settings, tmp_path_factory):
    """The tiny model with a context that holds the tools' description (its byte tokenizer
    spends ~0.85 tokens a character), served with the tiny draft."""
    directory = tmp_path_factory.mktemp("tiny-tools-model")
    tiny.save_tiny_model(directory, tiny.build_byte_tokenizer(), context=2048)
    return base_settings.replace(model=str(directory), port=0)


@pytest.fixture(scope="module")
def tool_runtime(tool_settings):
    return load_runtime(tool_settings)


@pytest.fixture
def http_server(servers, tool_settings, tool_runtime, serve_loaded):
    """start() -> (server, None, base_url) serving the tiny model with a long context."""

    async def start():
        server = await servers.start(tool_settings, serve_loaded(tool_runtime))
        return server, None, f"http://localhost:{server.http_port}"

    return start


def _streamed_calls(chunks) -> tuple[str, list[dict], str | None]:
    """Content, calls and finish reason from a stream, joined as a client joins them."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function"
                calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


async def test_a_required_call_is_valid_streamed_and_the_same_without_speculation(
    http_server,
) -> None:
    server, _, url = await http_server()
    request = {
        "model": model_id(server),
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 120,
    }
    async with sdk(url) as client:
        on = await client.chat.completions.create(**request)
        off = await client.chat.completions.create(**request, extra_body={"speculation": "off"})
        stream = await client.chat.completions.create(**request, stream=True)
        chunks = [chunk async for chunk in stream]
    choice = on.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    (other,) = off.choices[0].message.tool_calls
    assert (other.function.name, other.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    content, calls, finish = _streamed_calls(chunks)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]
    assert on.model_extra["kenspec"]["accepted"] > 0  # the forced keys were drafted


async def test_a_named_function_is_the_one_called(http_server) -> None:
    server, _, url = await http_server()
    async with sdk(url) as client:
        answer = await client.chat.completions.create(
            model=model_id(server),
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=0,
            max_tokens=60,
        )
    calls = answer.choices[0].message.tool_calls
    assert calls and all(call.function.name == "get_time" for call in calls)


async def test_the_tool_loop_runs_with_the_official_client(http_server) -> None:
    """Call, result, answer: the assistant's turn of calls (content null) and the tool's
    result go back in the chat; the next turns are answered, streamed and not."""
    server, _, url = await http_server()
    model = model_id(server)
    async with sdk(url) as client:
        first = await client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=120,
            temperature=0,
        )
        message = first.choices[0].message
        assert message.tool_calls
        chat = [*ASK, message.model_dump(exclude_none=True)]
        chat += [
            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": -3}'}
            for call in message.tool_calls
        ]
        second = await client.chat.completions.create(
            model=model, messages=chat, tools=TOOLS, max_tokens=24, temperature=0
        )
        assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
        stream = await client.chat.completions.create(
            model=model, messages=chat, tools=TOOLS, max_tokens=24, temperature=0, stream=True
        )
        content, calls, finish = _streamed_calls([chunk async for chunk in stream])
        assert content == (second.choices[0].message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments)
            for c in second.choices[0].message.tool_calls or ()
        ]
        assert finish == second.choices[0].finish_reason
        chat.append({"role": "user", "content": "Thanks. And tomorrow?"})
        third = await client.chat.completions.create(
            model=model, messages=chat, tools=TOOLS, tool_choice="none", max_tokens=8
        )
    assert third.choices[0].message.tool_calls is None
    assert third.choices[0].message.content


async def test_stops_are_allowed_with_tools(http_server) -> None:
    server, _, url = await http_server()
    async with sdk(url) as client:
        answer = await client.chat.completions.create(
            model=model_id(server), messages=ASK, tools=TOOLS, stop=["\n\n"], max_tokens=16
        )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"ignore_eos": True, "tool_choice": "required"}, "ignore_eos"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "x"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [{"role": "tool", "content": "3"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
            "messages[0].tool_calls",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
async def test_bad_tools_and_messages_are_a_400_naming_the_field(
    http_server, change, param
) -> None:
    server, _, url = await http_server()
    body = {"model": model_id(server), "messages": ASK, "tools": TOOLS, "max_tokens": 4}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        response = await client.post("/v1/chat/completions", json={**body, **change})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param), response.json()


def _grpc_request(**fields) -> pb.GenerateRequest:
    tools = [
        pb.Tool(
            name=tool["function"]["name"],
            description=tool["function"].get("description", ""),
            parameters=json.dumps(tool["function"]["parameters"]),
        )
        for tool in TOOLS
    ]
    chat = pb.Messages(messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])])
    return pb.GenerateRequest(
        messages=chat, tools=tools, stopping=pb.StoppingCriteria(max_new_tokens=120), **fields
    )


async def _one_required_call(server, url):
    """The call the OpenAI API answers ASK with, greedy, tool_choice required, one call."""
    async with sdk(url) as client:
        answer = await client.chat.completions.create(
            model=model_id(server),
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=120,
        )
    (call,) = answer.choices[0].message.tool_calls
    return call


async def test_grpc_calls_are_the_http_api_s(http_server) -> None:
    server, _, url = await http_server()
    call = await _one_required_call(server, url)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        request = _grpc_request(tool_choice=pb.TOOL_CHOICE_REQUIRED, parallel_tool_calls=False)
        responses = [r async for r in stub.Generate(request, timeout=TIMEOUT)]
    assert "".join(r.text for r in responses) == ""
    assert responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    deltas = [delta for r in responses for delta in r.tool_calls]
    assert deltas[0].name == call.function.name and deltas[0].id.startswith("call_")
    assert "".join(delta.arguments for delta in deltas) == call.function.arguments
    assert {delta.index for delta in deltas} == {0}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tool_choice": pb.TOOL_CHOICE_NONE, "tool_function": "get_time"}, "tool_function"),
        ({"tool_function": "nope"}, "tool_function"),
        ({"tool_choice": 9}, "tool_choice"),
        ({"response_format": pb.ResponseFormat(json_object=pb.JsonObject())}, "response_format"),
    ],
)
async def test_bad_grpc_tools_are_invalid_argument(http_server, fields, field) -> None:
    server, _, _ = await http_server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in stub.Generate(_grpc_request(**fields), timeout=TIMEOUT):
                pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(field), error.value.details()


async def test_tokenize_renders_the_tools_as_a_generation_does(http_server) -> None:
    server, _, url = await http_server()
    body = {"model": model_id(server), "messages": ASK, "tools": TOOLS}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        counted = (await client.post("/tokenize", json=body)).json()["count"]
        bare = (await client.post("/tokenize", json={**body, "tools": []})).json()["count"]
        answer = await client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        refused = await client.post("/tokenize", json={"prompt": "Hi", "tools": TOOLS})
    assert counted == answer.json()["usage"]["prompt_tokens"] > bare
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


HOSTILE_SCHEMAS = [
    {"$ref": "#"},  # (refers to itself: any object)
    {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}},
    {"type": "object", "properties": {"a": {"$ref": "http://example.com/x.json"}}},
    {"type": "object", "properties": {"a": {"type": "array", "minItems": 100000000}}},
    {"type": "object", "properties": {'"}\n%json {': {"type": "string"}}},
    {"type": "object", "required": ["missing"], "additionalProperties": False},
    {"not": {}},
]


@pytest.mark.parametrize("schema", HOSTILE_SCHEMAS, ids=range(len(HOSTILE_SCHEMAS)))
async def test_a_hostile_parameters_schema_is_answered_or_a_400(http_server, schema) -> None:
    server, _, url = await http_server()
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = {"model": model_id(server), "messages": ASK, "tools": tools, "max_tokens": 8}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        for choice in ("auto", "required"):
            answer = await client.post("/v1/chat/completions", json={**body, "tool_choice": choice})
            assert answer.status_code in (200, 400), answer.text
            if answer.status_code == 400:
                assert answer.json()["error"]["param"] == "tools"
        assert (await client.get("/health")).status_code == 200


async def test_the_bundled_client_joins_the_calls(http_server) -> None:
    server, _, url = await http_server()
    expected = await _one_required_call(server, url)
    async with AsyncClient(f"127.0.0.1:{server.port}", timeout=TIMEOUT) as client:
        completion = await client.generate_text(
            None,
            ASK,
            tools=TOOLS,
            max_new_tokens=120,
            tool_choice="required",
            parallel_tool_calls=False,
        )
    (call,) = completion.tool_calls
    assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)
    assert completion.finish_reason == "tool_calls" and completion.text == ""

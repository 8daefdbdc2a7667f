"""The request bodies real OpenAI-API clients send by default, replayed against the HTTP API:
Open WebUI, Continue, Roo Code and LangChain's ChatOpenAI, each a plain chat turn and its native
tool calling (client_payloads/, SOURCES.md names the code each body was read from). Every body
must be answered as OpenAI defines: 200, a chat.completion or SSE chunks ending in [DONE], and
with tools, tool_calls whose names were offered and whose arguments are JSON (valid against the
function's schema whenever tool_choice forces a call). LangChain is also driven live, and the
bodies it sends are checked against its fixtures.

The server here is the tiny model with a context of 8,192 (SmolLM2's) instead of 512: its
byte-level tokens cannot hold a client's tools, described in the prompt, in 512."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from kenspec.server.runtime import load_runtime
from tests.server.openai_api.test_openai_api import TIMEOUT, model_id

PAYLOADS = Path(__file__).parent / "client_payloads"
NAMES = sorted(path.stem for path in PAYLOADS.glob("*.json"))
CONTEXT = 8192  # SmolLM2's
FAST = 16  # a body's max_tokens / max_completion_tokens, lowered so the replay is quick
FORCED = 256  # room for a forced call's arguments
DEFAULT = 128  # the server's default new tokens (bodies without max_tokens)
FINISHED = ("stop", "length")
FINISHED_WITH_TOOLS = ("stop", "length", "tool_calls")


def _body(name: str) -> dict[str, Any]:
    return json.loads((PAYLOADS / f"{name}.json").read_text(encoding="utf-8"))


def _forced(body: dict[str, Any]) -> bool:
    """Whether tool_choice makes a call the answer: "required" or a named function."""
    choice = body.get("tool_choice")
    return bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))


def _prepared(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The body for the served model, the token budget it sends lowered (kept when absent)."""
    body = {**body, "model": model}
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body:
            body[key] = FORCED if _forced(body) else FAST
    return body


def _offered(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The offered functions' parameter schemas by name."""
    return {
        tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"}
        for tool in body.get("tools") or []
    }


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_settings(base_settings, tiny_model_dir, tmp_path_factory):
    """The session's tiny model (same weights, tokenizer and draft) with a context of 8,192;
    new tokens limited by the context, 128 by default."""
    directory = tmp_path_factory.mktemp("long-context") / "tiny-8k"
    shutil.copytree(tiny_model_dir, directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["max_position_embeddings"] = CONTEXT
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return base_settings.replace(
        model=str(directory), max_new_tokens_limit=0, default_max_new_tokens=DEFAULT
    )


@pytest.fixture(scope="module")
def long_runtime(long_settings):
    return load_runtime(long_settings)


@pytest.fixture
async def client_server(servers, long_settings, long_runtime, serve_loaded):
    """(server, base_url): the HTTP API over the long-context tiny model."""
    server = await servers.start(long_settings.replace(port=0), serve_loaded(long_runtime))
    return server, f"http://localhost:{server.http_port}"


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=TIMEOUT)


async def _replay(url: str, body: dict[str, Any]) -> None:
    """Post `body` (streamed if it says so) and check the answer is what OpenAI defines."""
    async with _client(url) as client:
        if body.get("stream"):
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                raw = (await response.aread()).decode()
                assert response.status_code == 200, raw
                assert response.headers["content-type"].startswith("text/event-stream")
            _check_streamed(body, raw)
        else:
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            _check_whole(body, response.json())


# --- what an answer must be -----------------------------------------------------------------


def _check_calls(body: dict[str, Any], calls: list[dict[str, Any]] | None, finish: str) -> None:
    """tool_calls as OpenAI defines them, for the tools (and tool_choice) the body sent."""
    offered = _offered(body)
    if not offered:
        assert not calls, f"tool calls without tools: {calls}"
        assert finish in FINISHED, finish
        return
    assert finish in FINISHED_WITH_TOOLS, finish
    if _forced(body):
        assert calls, f"tool_choice {body['tool_choice']!r} must be answered with a call"
    if not calls:
        return
    assert isinstance(calls, list)
    if body.get("parallel_tool_calls") is False:
        assert len(calls) == 1, f"parallel_tool_calls false, yet {len(calls)} calls"
    choice = body.get("tool_choice")
    for call in calls:
        assert isinstance(call.get("id"), str) and call["id"], call
        assert call.get("type") == "function", call
        function = call["function"]
        assert function["name"] in offered, f"{function['name']!r} was not offered"
        if isinstance(choice, dict):
            assert function["name"] == choice["function"]["name"]
        assert isinstance(function["arguments"], str), "arguments are a JSON string"
        if finish != "length":  # a call cut short may be incomplete; a finished one may not
            arguments = json.loads(function["arguments"])
            assert isinstance(arguments, dict), arguments
            jsonschema.validate(arguments, offered[function["name"]])
    if finish != "length":
        assert finish in ("tool_calls", "stop"), finish


def _check_usage(usage: dict[str, Any]) -> None:
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def _check_whole(body: dict[str, Any], answer: dict[str, Any]) -> None:
    assert answer["object"] == "chat.completion"
    assert isinstance(answer["id"], str) and answer["id"]
    assert isinstance(answer["created"], int)
    assert answer["model"] == body["model"]
    assert len(answer["choices"]) == 1
    choice = answer["choices"][0]
    assert choice["index"] == 0
    message = choice["message"]
    assert message["role"] == "assistant"
    calls = message.get("tool_calls")
    # content is text, or null in a turn of calls only
    assert isinstance(message.get("content"), str) or (message.get("content") is None and calls)
    _check_calls(body, calls, choice["finish_reason"])
    _check_usage(answer["usage"])


def _events(raw: str) -> Iterator[dict[str, Any]]:
    """The chunks of an SSE body that ends with [DONE]: `data: ` events, one line each."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")[:-2]
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
        yield json.loads(event.removeprefix("data: "))


def _assembled(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls streamed as delta.tool_calls: each index opens with its id, type and name;
    its arguments arrive in pieces."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for part in chunk["choices"][0]["delta"].get("tool_calls") or []:
            index = part["index"]
            function = part.get("function") or {}
            if index not in calls:
                assert part.get("id") and part.get("type") == "function", part
                assert function.get("name"), part
                calls[index] = {
                    "id": part["id"],
                    "type": "function",
                    "function": {"name": function["name"], "arguments": ""},
                }
            calls[index]["function"]["arguments"] += function.get("arguments") or ""
    assert sorted(calls) == list(range(len(calls))), sorted(calls)
    return [calls[index] for index in sorted(calls)]


def _check_streamed(body: dict[str, Any], raw: str) -> None:
    chunks = list(_events(raw))
    assert chunks and all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert all(chunk["model"] == body["model"] for chunk in chunks)
    if (body.get("stream_options") or {}).get("include_usage"):
        *chunks, last = chunks
        assert last["choices"] == [], "the usage chunk comes last, without choices"
        _check_usage(last["usage"])
        assert all(chunk.get("usage") is None for chunk in chunks)
    else:
        assert not any(chunk.get("usage") for chunk in chunks), "usage was not asked for"
    assert all(len(chunk["choices"]) == 1 for chunk in chunks)
    assert all(chunk["choices"][0]["index"] == 0 for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in chunks]
    assert finishes[-1] is not None and all(finish is None for finish in finishes[:-1]), finishes
    for chunk in chunks:
        content = chunk["choices"][0]["delta"].get("content")
        assert content is None or isinstance(content, str)
    _check_calls(body, _assembled(chunks), finishes[-1])


# --- replay ---------------------------------------------------------------------------------


def test_every_fixture_is_a_chat_body_for_the_placeholder_model() -> None:
    assert len(NAMES) >= 10, NAMES
    sources = (PAYLOADS / "SOURCES.md").read_text(encoding="utf-8")
    for name in NAMES:
        body = _body(name)
        assert body["model"] == "MODEL", name
        assert body["messages"] and all("role" in message for message in body["messages"])
        assert f"{name}.json" in sources, f"SOURCES.md does not name {name}.json"
        for tool in body.get("tools") or []:
            assert tool["type"] == "function" and tool["function"]["name"], name


@pytest.mark.parametrize("name", NAMES)
async def test_a_clients_default_body_is_answered_as_openai_defines(client_server, name) -> None:
    server, url = client_server
    await _replay(url, _prepared(_body(name), model_id(server)))


@pytest.mark.parametrize(
    "name", [name for name in NAMES if {"max_tokens", "max_completion_tokens"} & set(_body(name))]
)
async def test_the_max_tokens_a_client_sends_is_served_as_sent(client_server, name) -> None:
    """Continue asks for 4,096 new tokens on every request: within a context of 8,192 it is
    served (the first chunk read, then the connection dropped)."""
    server, url = client_server
    body = {**_body(name), "model": model_id(server)}
    assert body.get("stream"), "a streamed body: its first chunk shows it was served"
    async with (
        _client(url) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        if response.status_code != 200:
            await response.aread()
        assert response.status_code == 200, response.text
        async for line in response.aiter_lines():
            if line:
                chunk = json.loads(line.removeprefix("data: "))
                assert chunk["object"] == "chat.completion.chunk"
                break


TOOLS_OFFERED = [
    (name, tool["function"]["name"])
    for name in NAMES
    if not _forced(_body(name))
    for tool in _body(name).get("tools") or []
]


@pytest.mark.parametrize(("name", "function"), TOOLS_OFFERED)
async def test_each_tool_a_client_offers_can_be_forced(client_server, name, function) -> None:
    """The same bodies with tool_choice naming one of their tools: a call of that tool under
    the schema as the client wrote it (Open WebUI's defaults and empty parameters, Continue's
    open objects, Roo Code's strict ones), streamed or not as the client asks. The tiny random
    model mostly writes a free string (or, where the object is open, more keys) until
    max_tokens: then the call's framing is checked, its arguments only when it finishes."""
    server, url = client_server
    named = {"type": "function", "function": {"name": function}}
    await _replay(url, _prepared({**_body(name), "tool_choice": named}, model_id(server)))


# --- LangChain ------------------------------------------------------------------------------


class GetWeather(BaseModel):
    """Get the current weather in a given location"""

    location: str = Field(..., description="The city and state, e.g. San Francisco, CA")


def test_langchain_sends_the_bodies_of_its_fixtures() -> None:
    """ChatOpenAI's bodies, caught on the wire, are the fixtures (the model aside)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    sent: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        message = {"role": "assistant", "content": "Hi"}
        return httpx.Response(
            200,
            json={
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": "MODEL",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )

    llm = ChatOpenAI(
        model="MODEL",
        base_url="http://client.invalid/v1",
        api_key="unused",
        http_client=httpx.Client(transport=httpx.MockTransport(answer)),
    )
    llm.invoke("Hello")
    llm.bind_tools([GetWeather], tool_choice="required").invoke("What is the weather in Paris?")
    call = {"name": "GetWeather", "args": {"location": "Paris, France"}, "id": "call_abc123"}
    llm.bind_tools([GetWeather]).invoke(
        [
            SystemMessage("You are terse."),
            HumanMessage("What is the weather in Paris?"),
            AIMessage(content="", tool_calls=[{**call, "type": "tool_call"}]),
            ToolMessage(content="Sunny, 21 C", tool_call_id="call_abc123"),
        ]
    )
    names = ["langchain-chat", "langchain-bind-tools-required", "langchain-tool-result"]
    assert sent == [_body(name) for name in names]


class Forecast(BaseModel):
    """Get the weather forecast for a city"""

    city: Literal["Paris", "London", "Tokyo"] = Field(description="The city")
    unit: Literal["celsius", "fahrenheit"] = Field(description="The temperature unit")


@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream"])
async def test_langchain_bind_tools_required_gets_calls_that_fit_the_schema(
    client_server, streamed
) -> None:
    """ChatOpenAI(...).bind_tools([...], tool_choice="required"), invoked and streamed: an
    AIMessage whose tool_calls' args fit the tool's schema. The tool is a closed one (enums,
    strict, one call): the tiny random model, given a free string or an object open to more
    keys, writes on until max_tokens and the call is cut short (finish_reason "length")."""
    from langchain_core.messages import AIMessage
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_openai import ChatOpenAI

    server, url = client_server
    llm = ChatOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        model=model_id(server),
        max_retries=0,
        timeout=TIMEOUT,
    )
    bound = llm.bind_tools(
        [Forecast], tool_choice="required", strict=True, parallel_tool_calls=False
    )
    question = "What is the weather in Paris?"
    if streamed:
        message = None
        async for chunk in bound.astream(question):
            message = chunk if message is None else message + chunk
    else:
        message = await bound.ainvoke(question)
    assert isinstance(message, AIMessage), type(message)
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    assert len(message.tool_calls) == 1, message
    assert message.response_metadata["finish_reason"] in ("tool_calls", "stop")
    schema = convert_to_openai_tool(Forecast, strict=True)["function"]["parameters"]
    call = message.tool_calls[0]
    assert call["name"] == "Forecast" and call["id"]
    jsonschema.validate(call["args"], schema)

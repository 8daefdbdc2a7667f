"""Keyword arguments -> protobuf requests (pure functions, no server)."""

from __future__ import annotations

import doctest

import pytest

import kenspec.client.request
from kenspec.api import generator_pb2 as pb
from kenspec.client.request import build_generate_request, build_tokenize_request, chat_message


def test_defaults_leave_choices_to_the_server() -> None:
    request = build_generate_request("hi")

    assert request.WhichOneof("input") == "prompt"
    assert request.sampling.temperature == 0.0
    assert not request.sampling.HasField("seed")
    assert request.stopping.max_new_tokens == 0
    assert request.speculation.mode == pb.SPECULATION_MODE_AUTO
    assert not request.speculation.HasField("adaptive")
    assert request.speculation.draft_context == pb.DRAFT_CONTEXT_UNSPECIFIED


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        (("user", "hi"), ("user", "hi")),
        ({"role": "system", "content": "be brief"}, ("system", "be brief")),
        (pb.ChatMessage(role="assistant", content="ok"), ("assistant", "ok")),
    ],
)
def test_chat_message_forms(turn: object, expected: tuple[str, str]) -> None:
    message = chat_message(turn)  # type: ignore[arg-type]
    assert (message.role, message.content) == expected


@pytest.mark.parametrize("turn", [("user",), {"role": "user"}, "user: hi", ["user", "hi"]])
def test_bad_chat_messages(turn: object) -> None:
    with pytest.raises(ValueError):
        chat_message(turn)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"speculation": "on"},
        {"max_new_tokens": -1},  # protobuf rejects negative uint32
        {"seed": -5},
    ],
)
def test_bad_options_raise_value_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        build_generate_request("hi", **kwargs)  # type: ignore[arg-type]


def test_tokenize_request_needs_exactly_one_input() -> None:
    assert build_tokenize_request("hi", return_tokens=True).return_tokens
    with pytest.raises(ValueError, match="exactly one"):
        build_tokenize_request()
    with pytest.raises(ValueError, match="non-empty list"):
        build_tokenize_request(messages="hi")  # type: ignore[arg-type]


def test_docstring_examples() -> None:
    assert doctest.testmod(kenspec.client.request).failed == 0


def test_tools_and_tool_messages_are_mapped() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    request = build_generate_request(messages=chat, tools=tools, tool_choice="required")
    assert [(t.name, t.parameters) for t in request.tools] == [("f", '{"type": "object"}')]
    assert request.tool_choice == pb.TOOL_CHOICE_REQUIRED
    assert not request.HasField("parallel_tool_calls")
    assistant, tool = request.messages.messages[1:]
    assert (assistant.content, assistant.tool_calls[0].name) == ("", "f")
    assert tool.tool_call_id == "c1"
    named = build_generate_request(
        messages=chat[:1],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "f"}},
        parallel_tool_calls=False,
    )
    assert (named.tool_function, named.parallel_tool_calls) == ("f", False)
    with pytest.raises(ValueError, match="tool_choice"):
        build_generate_request(messages=chat[:1], tools=tools, tool_choice="always")

"""Build protobuf requests from the client's keyword arguments.

Defaults are the proto's zero values, which the server reads as "use the server default"
(greedy decoding, default max_new_tokens, default draft length); only what the caller sets
is sent. Range checks are the server's job: it knows its limits and says which one was hit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

from kenspec.api import generator_pb2 as pb

Speculation = Literal["auto", "off"]
# A chat turn: ("user", "Hi"), {"role": "user", "content": "Hi"} (OpenAI's shape: an
# assistant's "tool_calls", a tool's "tool_call_id"), or a pb.ChatMessage.
ChatTurn = tuple[str, str] | Mapping[str, Any] | pb.ChatMessage

_SPECULATION_MODES = {"auto": pb.SPECULATION_MODE_AUTO, "off": pb.SPECULATION_MODE_OFF}


class GenerateOptions(TypedDict, total=False):
    """Keyword options of `generate()` / `generate_text()`; see `build_generate_request`."""

    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    max_new_tokens: int
    stop: str | Sequence[str]
    ignore_eos: bool
    speculation: Speculation
    num_draft_tokens: int
    adaptive: bool | None
    draft_context: bool | None
    response_format: Mapping[str, Any] | None
    request_id: str
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float] | None
    n: int
    logprobs: bool
    top_logprobs: int
    tools: Sequence[Mapping[str, Any]]
    tool_choice: str | Mapping[str, Any]
    parallel_tool_calls: bool | None


def build_generate_request(
    prompt: str | None = None,
    messages: Sequence[ChatTurn] | None = None,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int | None = None,
    max_new_tokens: int = 0,
    stop: str | Sequence[str] = (),
    ignore_eos: bool = False,
    speculation: Speculation = "auto",
    num_draft_tokens: int = 0,
    adaptive: bool | None = None,
    draft_context: bool | None = None,
    response_format: Mapping[str, Any] | None = None,
    request_id: str = "",
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    n: int = 0,
    logprobs: bool = False,
    top_logprobs: int = 0,
    tools: Sequence[Mapping[str, Any]] = (),
    tool_choice: str | Mapping[str, Any] = "auto",
    parallel_tool_calls: bool | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; `None` for seed/adaptive/draft_context leaves the choice to the server.

    `response_format` is shaped as over HTTP: {"type": "json_object"}, {"type": "json_schema",
    "json_schema": {"schema": {...}}}, {"type": "regex", "regex": "..."} or {"type": "lark",
    "lark": "..."}; the output then matches it (docs/structured-output.md). `n` choices stream
    interleaved (each round says its `choice_index`); `logprobs` (with `top_logprobs`
    alternatives) come with every round; the penalties, `logit_bias` ({token id: amount}) and
    `min_p` are applied at every verified position (0 for a penalty, 0 or 1 for
    `repetition_penalty`: none). `tools` are OpenAI's (``{"type": "function", "function":
    {"name", "description", "parameters"}}``), `tool_choice` ``"auto"``, ``"none"``,
    ``"required"`` or ``{"type": "function", "function": {"name": ...}}``; the calls come back in
    each round's `tool_calls` (docs/tool-calls.md).

    >>> build_generate_request("Hi", stop="\\n", speculation="off").speculation.mode
    2
    """
    if speculation not in _SPECULATION_MODES:
        raise ValueError(f"speculation must be 'auto' or 'off', not {speculation!r}")
    request = pb.GenerateRequest(
        request_id=request_id,
        sampling=pb.SamplingParameters(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=dict(logit_bias or {}),
        ),
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stopping=pb.StoppingCriteria(
            max_new_tokens=max_new_tokens,
            stop=[stop] if isinstance(stop, str) else list(stop),
            ignore_eos=ignore_eos,
        ),
        speculation=pb.SpeculationParameters(
            mode=_SPECULATION_MODES[speculation],
            num_draft_tokens=num_draft_tokens,
            draft_context=_draft_context(draft_context),
        ),
    )
    if seed is not None:
        request.sampling.seed = seed
    if adaptive is not None:
        request.speculation.adaptive = adaptive
    if response_format is not None:
        request.response_format.CopyFrom(build_response_format(response_format))
    _set_tools(request, tools, tool_choice, parallel_tool_calls)
    _set_input(request, prompt, messages)
    return request


_TOOL_CHOICES = {
    "auto": pb.TOOL_CHOICE_AUTO,
    "none": pb.TOOL_CHOICE_NONE,
    "required": pb.TOOL_CHOICE_REQUIRED,
}


def _set_tools(
    request: pb.GenerateRequest,
    tools: Sequence[Mapping[str, Any]],
    choice: str | Mapping[str, Any],
    parallel: bool | None,
) -> None:
    for tool in tools:
        function = tool.get("function", tool)  # OpenAI's shape, or the function alone
        parameters = function.get("parameters")
        request.tools.append(
            pb.Tool(
                name=function.get("name", ""),
                description=function.get("description", ""),
                parameters=json.dumps(parameters) if parameters is not None else "",
            )
        )
    if isinstance(choice, Mapping):
        request.tool_function = choice.get("function", {}).get("name", "")
    elif choice in _TOOL_CHOICES:
        request.tool_choice = _TOOL_CHOICES[choice]
    else:
        raise ValueError(f"tool_choice must be auto, none, required or a function, not {choice!r}")
    if parallel is not None:
        request.parallel_tool_calls = parallel


def build_response_format(value: Mapping[str, Any]) -> pb.ResponseFormat:
    """The proto's ResponseFormat of an HTTP-shaped response_format (see above).

    >>> build_response_format({"type": "regex", "regex": "[0-9]+"}).regex
    '[0-9]+'
    """
    kind = value.get("type")
    if kind == "json_object":
        return pb.ResponseFormat(json_object=pb.JsonObject())
    if kind == "json_schema":
        schema = value.get("json_schema", {}).get("schema")
        if schema is None:
            return pb.ResponseFormat(json_object=pb.JsonObject())
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return pb.ResponseFormat(json_schema=text)
    if kind in ("regex", "lark"):
        return pb.ResponseFormat(**{kind: value.get(kind, "")})
    raise ValueError(
        f"response_format type must be json_object, json_schema, regex or lark, not {kind!r}"
    )


def build_tokenize_request(
    prompt: str | None = None,
    messages: Sequence[ChatTurn] | None = None,
    *,
    return_tokens: bool = False,
) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest(return_tokens=return_tokens)
    _set_input(request, prompt, messages)
    return request


def chat_message(turn: ChatTurn) -> pb.ChatMessage:
    """One chat turn as a ChatMessage; ``ValueError`` for anything else."""
    if isinstance(turn, pb.ChatMessage):
        return turn
    if isinstance(turn, Mapping):
        if not {"role", "content"} <= set(turn) <= _MESSAGE_KEYS:
            raise ValueError(
                f"a chat message dict has 'role' and 'content' (and tool_calls, tool_call_id, "
                f"name): {turn!r}"
            )
        calls = [
            pb.ToolCall(
                id=call.get("id", ""),
                name=call["function"]["name"],
                arguments=call["function"].get("arguments", ""),
            )
            for call in turn.get("tool_calls") or ()
        ]
        return pb.ChatMessage(
            role=turn["role"],
            content=turn["content"] or "",
            tool_calls=calls,
            tool_call_id=turn.get("tool_call_id") or "",
        )
    if isinstance(turn, tuple) and len(turn) == 2:
        role, content = turn
        return pb.ChatMessage(role=role, content=content)
    raise ValueError(f"a chat message is a (role, content) tuple or a dict, not {turn!r}")


_MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name"}


def _set_input(
    request: pb.GenerateRequest | pb.TokenizeRequest,
    prompt: str | None,
    messages: Sequence[ChatTurn] | None,
) -> None:
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt or messages")
    if prompt is not None:
        request.prompt = prompt
        return
    assert messages is not None
    if isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of chat messages")
    request.messages.messages.extend(chat_message(turn) for turn in messages)


def _draft_context(enabled: bool | None) -> pb.DraftContext:
    if enabled is None:
        return pb.DRAFT_CONTEXT_UNSPECIFIED
    return pb.DRAFT_CONTEXT_ON if enabled else pb.DRAFT_CONTEXT_OFF

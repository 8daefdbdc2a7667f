"""What a request asks of tools: the functions it offers, whether and which the model must call,
and the calls and results already in its chat.

OpenAI's shapes (the gRPC API maps onto the same types):

- ``tools``: ``[{"type": "function", "function": {"name", "description", "parameters",
  "strict"}}]``; a name is 1-64 of ``[A-Za-z0-9_-]`` (as OpenAI's), unique; ``parameters`` a JSON
  schema object (absent: any object); ``strict`` is accepted, and every call is held to its
  schema anyway.
- ``tool_choice``: ``"auto"`` (the default with tools), ``"none"``, ``"required"`` or
  ``{"type": "function", "function": {"name": ...}}`` (that function, called once at least).
- ``parallel_tool_calls``: false allows at most one call a turn.
- In the chat: an assistant message's ``tool_calls`` (``arguments`` a JSON text, given to the
  template as the object it holds, as templates expect), and ``tool`` messages answering one
  by ``tool_call_id``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kenspec.server.engine.params import InvalidParameter

MAX_TOOLS = 128  # OpenAI's limit
MAX_SCHEMA_CHARS = 100_000  # one function's parameters, as JSON
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
Choice = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None  # a JSON schema; None: any object

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        function["parameters"] = dict(self.parameters or {"type": "object", "properties": {}})
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: Choice = "auto"
    function: str | None = None  # choice "function": the one to call
    parallel: bool = True  # more than one call a turn

    @property
    def calls(self) -> bool:
        """Whether the model may call a tool this turn (else the tools are only described)."""
        return self.choice != "none"

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools a call may name this turn."""
        if self.choice == "function":
            return tuple(tool for tool in self.tools if tool.name == self.function)
        return self.tools


def parse_tools(tools: object, where: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's ``tools`` list (checked: names, uniqueness, each schema an object)."""
    if not isinstance(tools, list):
        raise InvalidParameter(where, "must be a list of {'type': 'function', 'function': ...}")
    if len(tools) > MAX_TOOLS:
        raise InvalidParameter(where, f"{len(tools)} tools; the limit is {MAX_TOOLS}")
    parsed: dict[str, Tool] = {}
    for index, entry in enumerate(tools):
        at = f"{where}[{index}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise InvalidParameter(f"{at}.type", "only 'function' tools are served")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise InvalidParameter(f"{at}.function", "must be an object with a name")
        tool = tool_of(function, f"{at}.function")
        if tool.name in parsed:
            raise InvalidParameter(f"{at}.function.name", f"{tool.name!r} is offered twice")
        parsed[tool.name] = tool
    return tuple(parsed.values())


def tool_of(function: Mapping[str, Any], at: str) -> Tool:
    """One function's name, description and parameters schema."""
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidParameter(f"{at}.name", "must be 1 to 64 of a-z, A-Z, 0-9, _ and -")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidParameter(f"{at}.description", "must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidParameter(f"{at}.strict", "must be true or false")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise InvalidParameter(f"{at}.parameters", "must be a JSON schema object")
        if len(json.dumps(parameters)) > MAX_SCHEMA_CHARS:
            raise InvalidParameter(
                f"{at}.parameters", f"longer than {MAX_SCHEMA_CHARS} characters as JSON"
            )
    return Tool(name, description or "", parameters)


def tool_request(
    tools: tuple[Tool, ...], choice: object, parallel: bool, where: str = "tool_choice"
) -> ToolRequest | None:
    """The request's tools with its ``tool_choice`` (OpenAI's forms); None without tools."""
    if choice is None or choice == "auto" or choice == "none" or choice == "required":
        mode: Choice = "auto" if choice is None else choice  # type: ignore[assignment]
        if mode == "required" and not tools:
            raise InvalidParameter(where, "'required' needs tools")
        return ToolRequest(tools, mode, None, parallel) if tools else None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not name:
        raise InvalidParameter(
            where,
            "must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
        )
    if all(tool.name != name for tool in tools):
        raise InvalidParameter(f"{where}.function.name", f"{name!r} is not one of the tools")
    return ToolRequest(tools, "function", name, parallel)


def history_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, each's arguments parsed from their JSON text."""
    if not isinstance(calls, list):
        raise InvalidParameter(where, "must be a list of tool calls")
    parsed = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidParameter(at, "must be {'id', 'type': 'function', 'function': {...}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParameter(f"{at}.function.name", "must be a non-empty string")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidParameter(f"{at}.id", "must be a string")
        parsed.append(
            history_call(call_id or "", name, function.get("arguments"), f"{at}.function")
        )
    return parsed


def history_call(call_id: str, name: str, arguments: object, at: str) -> dict[str, Any]:
    """One past call as templates read it: arguments as the object their JSON text holds."""
    if arguments is None or arguments == "":
        value: object = {}
    elif isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            raise InvalidParameter(f"{at}.arguments", "must be JSON text") from None
    else:
        raise InvalidParameter(f"{at}.arguments", "must be a string of JSON")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": value}}


def content_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """Characters of a chat's words: contents and past calls' arguments."""
    total = 0
    for message in messages:
        total += len(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            total += len(json.dumps(call["function"]["arguments"]))
    return total

"""A model's tool-call format: how its template is given the tools and past calls, what it
writes to call one, and the grammar that holds a call to its function's schema.

The format is read off the model's chat template once (``detect``), or set with
``--tool-call-format``:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, SmolLM3 ...): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, one block a call, text around them allowed;
- ``llama3_json`` (Llama 3.1-3.3): the answer is ``{"name": ..., "parameters": {...}}``, calls
  joined by ``; ``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
- ``prompt``: a template that renders no tools (SmolLM2's, Gemma 3's): kenspec describes the tools
  in the system message itself and asks for Hermes blocks; past calls and tool results are
  written into the messages as Hermes has them (``<tool_call>`` in the assistant's text, a user
  turn of ``<tool_response>`` blocks).

The grammar (llguidance's Lark, the JSON schemas inline) follows ``tool_choice``: ``auto`` leaves
text free until a trigger (a lazy lexeme: the text ends at the first ``<tool_call>``), then the
call must be one of the offered functions with arguments valid for its schema; ``required``
and a named function make the answer calls only; ``parallel_tool_calls: false`` allows one.
The keys and punctuation of a call are forced bytes, which speculation drafts (jump-forward).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import structlog
from transformers import PreTrainedTokenizerBase

from kenspec.server.engine.grammar import JSON_OPTIONS
from kenspec.server.tool_calls.parser import ToolCallParser
from kenspec.server.tool_calls.request import Tool, ToolRequest

log = structlog.get_logger("kenspec.tools")


_PROBE = Tool("kenspec_probe_function", "probe", {"type": "object", "properties": {}})


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str  # hermes, llama3_json, mistral; prompt is hermes with native False
    native: bool  # the template renders tools and calls itself
    trigger: str  # what opens a section of calls
    trigger_id: int | None = None  # the trigger's id when it is a special token (not in text)
    end: str = ""  # what closes a section (hermes: each call's block)
    between: str = ""  # characters allowed between calls in a section
    arguments_key: str = "arguments"
    at_start: bool = False  # calls only open the answer (llama3_json)

    @property
    def arguments_keys(self) -> tuple[str, ...]:
        """Keys the parser reads arguments from (models trained on one may write the other)."""
        return ("arguments", "parameters")

    def parser(self, decode: Callable[[Sequence[int]], str] | None = None) -> ToolCallParser:
        return ToolCallParser(self, self._new_id, decode)

    def _new_id(self) -> str:
        if self.name == "mistral":  # its templates check for 9 letters and digits
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return "call_" + secrets.token_hex(12)

    def chat(
        self, messages: Sequence[Mapping[str, Any]], tools: ToolRequest | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools to render the chat with (prompt: written into messages)."""
        if self.native:
            described = [tool.as_openai() for tool in tools.tools] if tools else None
            return [dict(message) for message in messages], described
        return _prompt_messages(messages, tools if tools and tools.calls else None), None

    def grammar(self, tools: ToolRequest) -> str:
        """The Lark grammar of a turn with `tools` (tool_choice other than none)."""
        schema, defs = _call_schema(tools.offered, self.arguments_key)
        forced = tools.choice != "auto"
        if self.name == "llama3_json":
            call = f"%json {json.dumps(_root(schema, defs))}"
            calls = f'{call} ("; " {call})*' if tools.parallel else call
            if forced:
                return f"%llguidance {{}}\nstart: {calls}\n"
            free = "FREE: /([^{](.|\\n)*)?/"  # text that does not open with "{"
            return f"%llguidance {{}}\nstart: calls | FREE\ncalls: {calls}\n{free}\n"
        if self.name == "mistral":
            array: dict[str, Any] = {"type": "array", "items": schema, "minItems": 1}
            if not tools.parallel:
                array["maxItems"] = 1
            body = f"%json {json.dumps(_root(array, defs))}"
            end = ""
        else:
            body = f'"\\n" %json {json.dumps(_root(schema, defs))}'
            end = json.dumps("\n" + self.end)
        trigger = f"<[{self.trigger_id}]>" if self.trigger_id is not None else None
        if forced:
            block = f"{trigger or json.dumps(self.trigger)} {body} {end}"
            blocks = 'block ("\\n" block)*' if tools.parallel else "block"
            return f"%llguidance {{}}\nstart: {blocks}\nblock: {block}\n"
        times = "*" if tools.parallel else "?"
        lines = [
            "%llguidance {}",
            f"start: call{times} tail",
            "tail: TEXT",
            "TEXT: /(.|\\n)*/",
        ]
        if trigger is not None:
            lines.append(f"call: TEXT {trigger} {body} {end}")
        else:  # the text ends at the first trigger
            lines.append(f"call_head[lazy]: TEXT {json.dumps(self.trigger)}")
            lines.append(f"call: call_head {body} {end}")
        return "\n".join(lines) + "\n"


def _call_schema(tools: Sequence[Tool], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One call of any of `tools`: its name, then its arguments, nothing else; and the
    definitions it refers to. Each function's parameters become a definition of the root
    (``#/$defs/kenspec_tool_<i>``), their own references rebased onto it, so that a schema's
    ``#``, ``#/$defs/...`` (pydantic writes these) mean what they meant in the tool."""
    options, defs = [], {}
    for index, tool in enumerate(tools):
        name = f"kenspec_tool_{index}"
        defs[name] = _rebased(tool.parameters or {"type": "object"}, f"#/$defs/{name}")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, key: {"$ref": f"#/$defs/{name}"}},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    return (options[0] if len(options) == 1 else {"anyOf": options}), defs


def _rebased(schema: object, root: str) -> Any:
    """`schema` with its local references (``#``, ``#/...``) pointing under `root`."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for name, value in schema.items():
        if name == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            rebased[name] = root + value[1:]
        else:
            rebased[name] = _rebased(value, root)
    return rebased


def _root(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """The grammar's schema: the definitions, and the JSON layout structured output writes
    (one space after : and ,)."""
    return {**schema, "$defs": dict(defs), "x-guidance": dict(JSON_OPTIONS)}


def detect(tokenizer: PreTrainedTokenizerBase, override: str = "auto") -> ToolFormat:
    """The format of a model: `override` unless auto, else what its template shows."""
    template = tokenizer.chat_template
    source = template if isinstance(template, str) else json.dumps(template or "")
    name = override
    native = override != "prompt" and (override != "auto" or _renders_tools(tokenizer))
    if name in ("auto", "prompt"):
        if not native:
            name = "hermes"
        elif "[TOOL_CALLS]" in source:
            name = "mistral"
        elif "<tool_call>" in source:
            name = "hermes"
        elif "parameters" in source and ("ipython" in source or "python_tag" in source):
            name = "llama3_json"
        else:
            name = "hermes"
            log.warning(
                "tool_call_format_unknown",
                detail="the chat template renders tools in a format kenspec does not know; "
                "reading calls as Hermes <tool_call> blocks (set --tool-call-format)",
            )
    return _format(tokenizer, name, native)


def _format(tokenizer: PreTrainedTokenizerBase, name: str, native: bool) -> ToolFormat:
    if name == "llama3_json":
        return ToolFormat(name, native, "{", between=";", arguments_key="parameters", at_start=True)
    if name == "mistral":
        trigger = "[TOOL_CALLS]"
        return ToolFormat(name, native, trigger, _special_id(tokenizer, trigger), between="[,]")
    trigger = "<tool_call>"
    return ToolFormat("hermes", native, trigger, _special_id(tokenizer, trigger), "</tool_call>")


def _special_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    """The id of `text` when it is one special token (decoded text leaves those out)."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != text:
        return None  # (the unknown token's id)
    return token_id if token_id in set(tokenizer.all_special_ids) else None


def _renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the template writes the tools it is given into the prompt."""
    chat = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(
            chat, tools=[_PROBE.as_openai()], add_generation_prompt=True, tokenize=False
        )
    except (jinja2.TemplateError, TypeError, ValueError):
        return False
    return isinstance(text, str) and _PROBE.name in text


PROMPT = """# Tools

You may call one or more functions to answer. The functions, as JSON schemas, are within \
<tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments within \
<tool_call></tool_call> tags, one block a call:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


def _prompt_messages(
    messages: Sequence[Mapping[str, Any]], tools: ToolRequest | None
) -> list[dict[str, Any]]:
    """A chat with tools for a template that knows none: the tools described in the system
    message, past calls as Hermes blocks in the assistant's text, tool results as a user turn."""
    written: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if written and written[-1].get("tool_results"):
                written[-1]["content"] += "\n" + block
            else:
                written.append({"role": "user", "content": block, "tool_results": True})
            continue
        calls = message.get("tool_calls") or ()
        blocks = [_block(call["function"]) for call in calls]
        written.append({"role": role, "content": "\n".join(filter(None, [content, *blocks]))})
    for message in written:
        message.pop("tool_results", None)
    if tools is not None:
        described = "\n".join(json.dumps(tool.as_openai()) for tool in tools.tools)
        text = PROMPT.format(tools=described)
        if written and written[0]["role"] == "system":
            written[0]["content"] = f"{written[0]['content']}\n\n{text}"
        else:
            written.insert(0, {"role": "system", "content": text})
    return written


def _block(function: Mapping[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

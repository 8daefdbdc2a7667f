"""server.tool_calls: each format's calls parsed from the model's text, the same whether the
text comes whole or a character at a time; what is not a call stays content; the grammar of a
turn holds a call to its function's schema; a template without tools gets kenspec's prompt,
one with tools renders them itself."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import llguidance
import llguidance.hf
import pytest

from kenspec.api.outputs import FinishReason
from kenspec.server.engine.params import InvalidParameter
from kenspec.server.runtime import load_runtime
from kenspec.server.tool_calls.formats import PROMPT, ToolFormat, _format, detect
from kenspec.server.tool_calls.parser import ChoiceParsers, Parsed, whole
from kenspec.server.tool_calls.request import (
    Tool,
    ToolRequest,
    history_calls,
    parse_tools,
    tool_request,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = (Tool("get_weather", "The weather in a city", WEATHER), Tool("get_time"))
HERMES_TEMPLATE = (Path(__file__).parent / "hermes_template.jinja").read_text(encoding="utf-8")


def _hermes(tokenizer) -> ToolFormat:
    return _format(tokenizer, "hermes", True)


def _streamed(fmt: ToolFormat, text: str) -> tuple[str, list[dict]]:
    """The text fed one character at a time, the deltas joined as a client joins them."""
    parser, parsed = fmt.parser(), Parsed()
    for char in text:
        parsed.add(parser.feed(char))
    parsed.add(parser.finish())
    calls: list[dict] = []
    for delta in parsed.calls:
        if delta.name is not None:
            assert delta.index == len(calls) and delta.arguments == ""  # OpenAI's first delta
            calls.append({"id": delta.id, "name": delta.name, "arguments": ""})
        else:
            calls[delta.index]["arguments"] += delta.arguments
    return parsed.content, calls


def _calls(calls: list[dict]) -> list[tuple[str, str]]:
    return [
        (call["function"]["name"], call["function"]["arguments"])
        if "function" in call
        else (call["name"], call["arguments"])
        for call in calls
    ]


HERMES_TEXT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris {x}", "days": 2, "n": [1, {"a": "}"}]}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
CASES = [
    ("hermes", HERMES_TEXT, "Let me look.\n", 2),
    (
        "llama3_json",
        ' {"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        2,
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}, '
        '{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]',
        "",
        2,
    ),
]


@pytest.mark.parametrize(("name", "text", "content", "count"), CASES)
def test_each_format_gives_the_same_calls_whole_and_streamed(
    tiny_target, name, text, content, count
) -> None:
    fmt = _format(tiny_target.tokenizer, name, True)
    whole_content, calls = whole(fmt.parser(), text)
    streamed_content, deltas = _streamed(fmt, text)
    assert whole_content == streamed_content == content
    assert len(calls) == count
    assert _calls(calls) == _calls(deltas)
    for call in calls:
        json.loads(call["function"]["arguments"])  # each is the arguments' JSON text
    assert all(call["id"].startswith("call_") or name == "mistral" for call in calls)


def test_arguments_are_the_text_the_model_wrote_and_a_json_string_is_decoded(tiny_target):
    hermes = _hermes(tiny_target.tokenizer)
    _, calls = whole(hermes.parser(), HERMES_TEXT)
    assert calls[0]["function"]["arguments"] == (
        '{"city": "Paris {x}", "days": 2, "n": [1, {"a": "}"}]}'
    )
    mistral = _format(tiny_target.tokenizer, "mistral", True)
    _, calls = whole(mistral.parser(), CASES[2][1])
    assert calls[1]["function"]["arguments"] == '{"zone": "UTC"}'
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()  # as Mistral's templates check


@pytest.mark.parametrize(
    "text",
    [
        "No call here, just text with a < and a <tool",  # a trigger's start, then the end
        "A <tool_call> that is not followed by a call",
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call> (no name)',
    ],
)
def test_what_is_not_a_call_stays_content(tiny_target, text) -> None:
    hermes = _hermes(tiny_target.tokenizer)
    assert whole(hermes.parser(), text) == (text, [])
    assert _streamed(hermes, text) == (text, [])


def test_llama3_calls_only_open_the_answer(tiny_target) -> None:
    llama = _format(tiny_target.tokenizer, "llama3_json", True)
    text = 'The call would be {"name": "get_time", "parameters": {}}'
    assert whole(llama.parser(), text) == (text, [])


def test_a_call_cut_short_keeps_the_arguments_written_so_far(tiny_target) -> None:
    hermes = _hermes(tiny_target.tokenizer)
    text = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    content, calls = whole(hermes.parser(), text)
    assert content == "Hi "
    assert _calls(calls) == [("get_weather", '{"city": "Pa')]
    assert _calls(_streamed(hermes, text)[1]) == _calls(calls)


def test_a_special_token_trigger_is_found_among_the_round_s_tokens(tiny_target) -> None:
    """A trigger that is a special token is not in the decoded text: the round's ids show it,
    and the text of the tokens before it is content."""
    fmt = replace(_format(tiny_target.tokenizer, "mistral", True), trigger_id=7)
    decoded = {(1, 2): "Sure. "}
    parser = fmt.parser(decode=lambda ids: decoded[tuple(ids)])
    first = parser.feed('Sure. [{"name": "get_time", ', (1, 2, 7, 9, 9))
    rest = parser.feed('"arguments": {}}]', (9, 9))
    rest.add(parser.finish())
    assert first.content == "Sure. "
    assert [(d.name, d.arguments) for d in first.calls + rest.calls] == [
        ("get_time", ""),
        (None, "{}"),
    ]


def _matcher(tokenizer, grammar: str) -> llguidance.LLMatcher:
    lltokenizer = llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id]
    )
    matcher = llguidance.LLMatcher(lltokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _accepts(matcher: llguidance.LLMatcher, tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_the_grammar_takes_valid_calls_and_refuses_others(tiny_target, name) -> None:
    tokenizer = tiny_target.tokenizer
    fmt = _format(tokenizer, name, True)
    key = fmt.arguments_key
    good = json.dumps({"name": "get_weather", key: {"city": "Oslo", "days": 2}})
    bad_args = json.dumps({"name": "get_weather", key: {"city": "Oslo", "days": 9}})
    unknown = json.dumps({"name": "get_news", key: {}})
    wrap = {
        "hermes": lambda call: f"<tool_call>\n{call}\n</tool_call>",
        "llama3_json": lambda call: call,
        "mistral": lambda call: f"[TOOL_CALLS][{call}]",
    }[name]
    required = fmt.grammar(ToolRequest(TOOLS, "required"))
    assert _accepts(_matcher(tokenizer, required), tokenizer, wrap(good))
    for text in (wrap(bad_args), wrap(unknown), "Just text."):
        assert not _accepts(_matcher(tokenizer, required), tokenizer, text), text
    auto = fmt.grammar(ToolRequest(TOOLS, "auto"))
    assert _accepts(_matcher(tokenizer, auto), tokenizer, "Just text.")
    if name != "llama3_json":  # (its calls open the answer)
        assert _accepts(_matcher(tokenizer, auto), tokenizer, "Sure. " + wrap(good))
        assert not _accepts(_matcher(tokenizer, auto), tokenizer, "Sure. " + wrap(bad_args))
    named = fmt.grammar(ToolRequest(TOOLS, "function", "get_time"))
    assert not _accepts(_matcher(tokenizer, named), tokenizer, wrap(good))


def test_auto_forces_the_call_s_keys_after_the_trigger(tiny_target) -> None:
    """After the trigger, the keys and punctuation are forced tokens (drafted by jump-forward)."""
    tokenizer = tiny_target.tokenizer
    grammar = _hermes(tokenizer).grammar(ToolRequest(TOOLS[:1], "auto"))
    matcher = _matcher(tokenizer, grammar)
    matcher.consume_tokens(tokenizer.encode("Ok <tool_call>", add_special_tokens=False))
    forced = tokenizer.decode(matcher.compute_ff_tokens())
    assert forced.startswith('\n{"name": "get_weather", "arguments": {"')


def test_without_parallel_calls_the_grammar_allows_one(tiny_target) -> None:
    tokenizer = tiny_target.tokenizer
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    one = _hermes(tokenizer).grammar(ToolRequest(TOOLS, "required", parallel=False))
    many = _hermes(tokenizer).grammar(ToolRequest(TOOLS, "required"))
    assert _accepts(_matcher(tokenizer, many), tokenizer, f"{call}\n{call}")
    assert not _accepts(_matcher(tokenizer, one), tokenizer, f"{call}\n{call}")
    ids = tokenizer.encode(call, add_special_tokens=False)
    matcher = _matcher(tokenizer, one)
    matcher.consume_tokens(ids)
    assert matcher.is_accepting()


OSLO = '{"city": "Oslo"}'


def test_a_template_without_tools_gets_kenspec_s_prompt(tiny_target) -> None:
    fmt = detect(tiny_target.tokenizer)
    assert (fmt.name, fmt.native) == ("hermes", False)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and the time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": history_calls(
                [
                    {
                        "id": "a",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    },
                    {"id": "b", "function": {"name": "get_time", "arguments": "{}"}},
                ],
                "tool_calls",
            ),
        },
        {"role": "tool", "tool_call_id": "a", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
    ]
    messages, described = fmt.chat(history, ToolRequest(TOOLS))
    assert described is None
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(TOOLS[0].as_openai()) in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    # the two results in one user turn, as Hermes templates write them
    results = [f"<tool_response>\n{text}\n</tool_response>" for text in ("-3 C", "12:00")]
    assert messages[3] == {"role": "user", "content": "\n".join(results)}
    assert len(messages) == 4
    text = tiny_target.chat_text(messages)
    assert "<|im_start|>user\n<tool_response>" in text
    none, _ = fmt.chat(history[1:2], ToolRequest(TOOLS, "none"))
    assert none == history[1:2]  # tool_choice none: the tools are not described
    assert PROMPT.split("\n")[0] not in tiny_target.chat_text(none)


def test_a_template_with_tools_renders_them_itself(base_settings, tmp_path) -> None:
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE, encoding="utf-8")
    runtime = load_runtime(base_settings.replace(chat_template=str(template), draft="none"))
    fmt = runtime.tool_format
    assert (fmt.name, fmt.native) == ("hermes", True)
    chat = [{"role": "user", "content": "Weather?"}]
    messages, described = fmt.chat(chat, ToolRequest(TOOLS))
    assert messages == chat and described == [tool.as_openai() for tool in TOOLS]
    text = runtime.engine.target.chat_text(messages, described)
    assert '"name": "get_weather"' in text and "<tools>" in text
    forced = load_runtime(
        base_settings.replace(
            chat_template=str(template), draft="none", tool_call_format="llama3_json"
        )
    )
    assert (forced.tool_format.name, forced.tool_format.native) == ("llama3_json", True)


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        ({"type": "function"}, None, "tools"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f"}}] * 2,
            None,
            "tools[1].function.name",
        ),
        ([{"type": "function", "function": {"name": "f"}}], "sometimes", "tool_choice"),
        (
            [{"type": "function", "function": {"name": "f"}}],
            {"type": "function", "function": {"name": "g"}},
            "tool_choice.function.name",
        ),
        ([], "required", "tool_choice"),
    ],
)
def test_bad_tools_name_the_field(tools, choice, field) -> None:
    with pytest.raises(InvalidParameter) as error:
        tool_request(parse_tools(tools), choice, True)
    assert error.value.field == field


def test_past_arguments_must_be_json_text() -> None:
    call = {"id": "a", "function": {"name": "f", "arguments": "{not json"}}
    with pytest.raises(InvalidParameter) as error:
        history_calls([call], "messages[1].tool_calls")
    assert error.value.field == "messages[1].tool_calls[0].function.arguments"
    parsed = history_calls([{"function": {"name": "f", "arguments": '{"a": 1}'}}], "tool_calls")
    assert parsed[0]["function"]["arguments"] == {"a": 1}  # as templates read them


def test_whitespace_after_calls_is_no_content_but_text_after_them_is(tiny_target) -> None:
    hermes = _hermes(tiny_target.tokenizer)
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    for text, content in [(f"{call}\n\n", ""), (f"{call}\n\nDone.", "\n\nDone.")]:
        assert whole(hermes.parser(), text)[0] == content
        assert _streamed(hermes, text)[0] == content


def test_a_schema_s_own_references_keep_their_meaning(tiny_target) -> None:
    """pydantic writes "$defs" and "#/$defs/..." references; "#" is the schema itself. In the
    grammar each function's schema is a definition of the root: its references are rebased."""
    tokenizer = tiny_target.tokenizer
    item = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    order = {
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}, "next": {"$ref": "#"}},
        "required": ["item"],
        "$defs": {"Item": item},
    }
    grammar = _hermes(tokenizer).grammar(ToolRequest((Tool("order", "", order),), "required"))

    def call(arguments: str) -> str:
        return f'<tool_call>\n{{"name": "order", "arguments": {arguments}}}\n</tool_call>'

    good = call('{"item": {"n": 1}, "next": {"item": {"n": 2}}}')
    assert _accepts(_matcher(tokenizer, grammar), tokenizer, good)
    for bad in ('{"item": {"x": 1}}', '{"item": {"n": 1}, "next": {"item": {"x": 2}}}'):
        assert not _accepts(_matcher(tokenizer, grammar), tokenizer, call(bad)), bad


class _Words:
    """A tokenizer stand-in: ids are never decoded (a trigger in text needs no decoding)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        raise AssertionError("a text trigger needs no decoding")


def test_each_choice_has_its_own_parser_and_calls_end_a_turn_as_tool_calls() -> None:
    hermes = ToolFormat("hermes", False, "<tool_call>", None, "</tool_call>")
    parsers = ChoiceParsers(hermes, _Words())
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    cut = call.index(":", call.index('"x"'))  # the name sent once the arguments begin
    first, ended = parsers.round(0, call[:cut], [], None)
    assert ended is None and first.calls[0].name == "f"
    other, ended = parsers.round(1, "plain text", [], FinishReason.EOS)
    assert (other.content, other.calls, ended) == ("plain text", [], FinishReason.EOS)
    rest, ended = parsers.round(0, call[cut:], [], FinishReason.EOS)
    assert ended == FinishReason.TOOL_CALLS and rest.content == ""
    assert parsers.round(2, call, [], FinishReason.LENGTH)[1] == FinishReason.LENGTH
    content, calls, ended = ChoiceParsers(hermes, _Words()).whole(0, call, [], FinishReason.EOS)
    assert (content, ended) == ("", FinishReason.TOOL_CALLS)
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x": 1}'}]

"""The model's output, round by round, split into content and tool-call deltas as OpenAI
streams them: a call's first delta carries its index, id and name (arguments ""), the next ones
pieces of its arguments' JSON text; the pieces joined are the arguments exactly as written.

Every supported format writes a call as a JSON object holding the function's name and its
arguments (``"arguments"``, or ``"parameters"`` in Llama 3's), so one scanner serves them all;
formats differ only in what opens a section of calls (``ToolFormat.trigger``: ``<tool_call>``,
``[TOOL_CALLS]``, or a ``{`` that starts the answer) and what may stand between calls. Text
that might be the start of a trigger is held back until the next round tells.

What is not a well-formed call stays content: a trigger followed by anything but a call, a
call object without a name. A call cut short (the token limit) keeps the arguments sent so far,
and the finish reason says ``length``. With the grammar on (formats.grammar), calls are well
formed by construction; the parser is as lenient as it can be without it (a tool choice of
``none``, a format override).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kenspec.api.outputs import FinishReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kenspec.server.tool_calls.formats import ToolFormat


@dataclass(slots=True)
class CallDelta:
    """A piece of call `index`: its id and name in the first, then argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's streamed ``delta.tool_calls[]`` entry."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class Parsed:
    """What one piece of output adds: content text and call deltas."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, other: Parsed) -> None:
        self.content += other.content
        self.calls += other.calls


class _Call:
    """One call object, scanned a character at a time: where its top-level values start and
    end, its name once read, and its arguments streamed while they are written."""

    def __init__(self, arguments_keys: tuple[str, ...]) -> None:
        self.text = ""
        self._keys = arguments_keys
        self._depth = 0
        self._in_string = self._escaped = False
        self._expect = "key"  # at depth 1: key, key_string, colon, value, in_value
        self._key = ""
        self._start = 0  # where the key or value being read starts
        self.name: str | None = None
        self.arguments: str | None = None  # the finished arguments' JSON text
        self.done = False

    def push(self, text: str) -> int:
        """Scan `text`; returns how many characters belong to the object (all, unless it
        closed: the rest is the caller's)."""
        for offset, char in enumerate(text):
            position = len(self.text)
            self.text += char
            self._scan(char, position)
            if self.done:
                return offset + 1
        return len(text)

    def _scan(self, char: str, at: int) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._depth == 1 and self._expect == "key_string":
                    self._key, self._expect = _string(self.text[self._start : at + 1]), "colon"
            return
        top = self._depth == 1
        if char == '"':
            self._in_string = True
            if top and self._expect == "key":
                self._start, self._expect = at, "key_string"
            elif top and self._expect == "value":
                self._start, self._expect = at, "in_value"
        elif char in "{[":
            if top and self._expect == "value":
                self._start, self._expect = at, "in_value"
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value(at)
                self.done = True
        elif top and char == ":" and self._expect == "colon":
            self._expect = "value"
        elif top and char == ",":
            self._end_value(at)
            self._expect = "key"
        elif top and self._expect == "value" and not char.isspace():
            self._start, self._expect = at, "in_value"  # a number, true, null, ...

    def _end_value(self, at: int) -> None:
        if self._expect != "in_value":
            return
        value = self.text[self._start : at].strip()
        if self._key == "name":
            name = _value(value)
            self.name = name if isinstance(name, str) and name else None
        elif self._key in self._keys:
            self.arguments = value

    def streamable(self) -> str | None:
        """The arguments written so far while they are an object being written (whitespace at
        the end held back); None otherwise."""
        if self._expect != "in_value" or self._key not in self._keys:
            return None
        if self.text[self._start] not in "{[":
            return None  # a string holding JSON, a number: sent whole at the end
        return self.text[self._start :].rstrip()

    def final_arguments(self) -> str:
        """The arguments' JSON text as OpenAI sends it (a string's JSON decoded; none: {})."""
        if self.arguments is None:
            return "{}"
        value = _value(self.arguments)
        return value if isinstance(value, str) else self.arguments


def _string(text: str) -> str:
    value = _value(text)
    return value if isinstance(value, str) else ""


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


class ToolCallParser:
    """One choice's output, fed round by round (`feed`), then `finish`ed."""

    def __init__(
        self,
        tool_format: ToolFormat,
        new_id: Callable[[], str],
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self._format = tool_format
        self._new_id = new_id
        self._decode = decode  # token ids to text: finds a special-token trigger in a round
        self._held = ""  # text that may be the start of a trigger
        self._section = False  # inside a section of calls
        self._marker = ""  # a section's closing text being read (``</tool_call>``)
        self._raw = ""  # the section's text so far (content again if no call follows)
        self._call: _Call | None = None
        self._sent = ""  # the current call's arguments sent so far
        self._plain = False  # the answer is text only (a format whose calls open it)
        self._open_call = False  # the current call's first delta is sent
        self.calls = 0  # calls begun (their first delta sent)

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> Parsed:
        trigger_id = self._format.trigger_id
        if trigger_id is None or trigger_id not in token_ids or self._section:
            return self._text(text)
        # A special-token trigger: absent from the text, found among the round's tokens.
        parsed = Parsed()
        at = list(token_ids).index(trigger_id)
        before = self._decode(token_ids[:at]) if self._decode is not None and at else ""
        before = before if text.startswith(before) else ""
        parsed.add(self._text(before))
        self._open()
        parsed.add(self._text(text[len(before) :]))
        return parsed

    def finish(self) -> Parsed:
        """What is still held: text, an unfinished section or call."""
        parsed = Parsed(content="" if self._between_calls(self._held) else self._held)
        call = self._call
        if call is not None and self._open_call:  # cut short: the arguments written so far
            rest = self._arguments_left(call)
            if rest:
                parsed.calls.append(CallDelta(self.calls - 1, rest))
        elif self._raw.strip(" \t\r\n" + self._format.between):
            parsed.content += self._raw  # a trigger, or a call without its name, then the end
        self._held, self._raw, self._call, self._section = "", "", None, False
        return parsed

    def _text(self, text: str) -> Parsed:
        parsed = Parsed()
        while text:
            step = self._in_section if self._section else self._outside
            text = step(text, parsed)
        return parsed

    def _outside(self, text: str, parsed: Parsed) -> str:
        """Text outside calls: content, up to a trigger."""
        fmt, held = self._format, self._held + text
        self._held = ""
        if self._plain:
            parsed.content += held
            return ""
        if fmt.at_start:  # calls open the answer, or there are none
            stripped = held.lstrip()
            if not stripped:
                self._held = held
                return ""
            if not stripped.startswith(fmt.trigger):
                self._plain = True
                parsed.content += held
                return ""
            self._open()
            return stripped
        if fmt.trigger_id is not None:  # a special token: found by feed
            parsed.content += held
            return ""
        found = held.find(fmt.trigger)
        if found < 0:
            keep = _prefix_tail(held, fmt.trigger)
            if self._between_calls(held[: len(held) - keep]):
                keep = len(held)  # held until text comes: none may
            parsed.content += held[: len(held) - keep]
            self._held = held[len(held) - keep :]
            return ""
        if not self._between_calls(held[:found]):
            parsed.content += held[:found]
        self._open()
        self._raw = fmt.trigger
        return held[found + len(fmt.trigger) :]

    def _between_calls(self, text: str) -> bool:
        """Whitespace after a call: no content (unless text follows it)."""
        return self.calls > 0 and not text.strip()

    def _open(self) -> None:
        self._section, self._marker, self._raw = True, "", ""

    def _in_section(self, text: str, parsed: Parsed) -> str:
        """Inside a section: between calls, or in one."""
        call = self._call
        if call is not None:
            used = call.push(text)
            self._raw += text[:used]
            self._stream(call, parsed)
            if call.done:
                self._close(call, parsed)
            return text[used:]
        fmt = self._format
        for offset, char in enumerate(text):
            if char == "{" and not self._marker:
                self._call = _Call(fmt.arguments_keys)
                return text[offset:]
            self._raw += char
            if char.isspace() or char in fmt.between:
                continue
            self._marker += char
            if fmt.end and self._marker == fmt.end:
                self._section, self._raw = False, ""
                return text[offset + 1 :]
            if not (fmt.end and fmt.end.startswith(self._marker)):  # not a call after all
                parsed.content += self._raw
                self._section, self._raw = False, ""
                self._plain = fmt.at_start
                return text[offset + 1 :]
        return ""

    def _stream(self, call: _Call, parsed: Parsed) -> None:
        """Send the call's name once known and its arguments as they are written."""
        written = call.streamable()
        if written is None or call.name is None or call.done:  # (done: _close sends the rest)
            return
        if not self._open_call:
            self._begin(call, parsed)
        if written.startswith(self._sent) and len(written) > len(self._sent):
            parsed.calls.append(CallDelta(self.calls - 1, written[len(self._sent) :]))
            self._sent = written

    def _begin(self, call: _Call, parsed: Parsed) -> None:
        assert call.name is not None
        parsed.calls.append(CallDelta(self.calls, "", self._new_id(), call.name))
        self.calls += 1
        self._open_call, self._sent = True, ""

    def _close(self, call: _Call, parsed: Parsed) -> None:
        """A call object closed: the rest of its arguments, or content if it was no call."""
        self._call = None
        if call.name is None:
            parsed.content += self._raw
            self._section, self._raw = False, ""
            return
        if not self._open_call:
            self._begin(call, parsed)
        rest = self._arguments_left(call)
        if rest:
            parsed.calls.append(CallDelta(self.calls - 1, rest))
        self._open_call, self._sent, self._raw = False, "", ""

    def _arguments_left(self, call: _Call) -> str:
        final = call.final_arguments() if call.done else (call.streamable() or "")
        if call.done and not final.startswith(self._sent):
            return ""  # (sent pieces of another reading; cannot happen for an object)
        return final[len(self._sent) :]


def _prefix_tail(text: str, trigger: str) -> int:
    """Length of the longest end of `text` that begins `trigger`."""
    for size in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0


def whole(parser: ToolCallParser, text: str, token_ids: Sequence[int] = ()) -> tuple[str, list]:
    """A whole answer's content and calls (OpenAI's ``message.tool_calls``)."""
    parsed = parser.feed(text, token_ids)
    parsed.add(parser.finish())
    calls: list[dict[str, Any]] = []
    for delta in parsed.calls:
        if delta.name is not None:
            calls.append(delta.as_openai())
            calls[-1].pop("index")
        else:
            calls[delta.index]["function"]["arguments"] += delta.arguments
    return parsed.content, calls


def ended_as(reason: FinishReason, calls: int) -> FinishReason:
    """A turn that made calls and ended as the model chose (EOS) ends as TOOL_CALLS."""
    return FinishReason.TOOL_CALLS if calls and reason == FinishReason.EOS else reason


class ChoiceParsers:
    """A request's answers split into content and calls, for both APIs: one parser per
    choice (n > 1), made on its first round; the tokenizer decodes a special-token trigger."""

    def __init__(self, format: ToolFormat, tokenizer: PreTrainedTokenizerBase) -> None:
        self._format = format
        self._decode: Callable[[Sequence[int]], str] = lambda ids: tokenizer.decode(
            ids, skip_special_tokens=True
        )
        self._parsers: dict[int, ToolCallParser] = {}

    def of(self, choice: int) -> ToolCallParser:
        if choice not in self._parsers:
            self._parsers[choice] = self._format.parser(self._decode)
        return self._parsers[choice]

    def round(
        self, choice: int, text: str, token_ids: Sequence[int], finish: FinishReason | None
    ) -> tuple[Parsed, FinishReason | None]:
        """A round's content and call deltas, and (its last round) the choice's finish reason."""
        parser = self.of(choice)
        parsed = parser.feed(text, token_ids)
        if finish is None:
            return parsed, None
        parsed.add(parser.finish())
        return parsed, ended_as(finish, parser.calls)

    def whole(
        self, choice: int, text: str, token_ids: Sequence[int], finish: FinishReason | None
    ) -> tuple[str, list[dict[str, Any]], FinishReason | None]:
        """A whole answer's content, calls (OpenAI's ``message.tool_calls``) and finish."""
        content, calls = whole(self.of(choice), text, token_ids)
        return content, calls, ended_as(finish, len(calls)) if finish else None

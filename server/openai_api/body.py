"""From the bytes of an HTTP request body to a JSON object every later check can trust.

What this refuses, each as a 400, so that no later code meets it: bytes that are not UTF-8,
text that is not JSON (``NaN`` and ``Infinity`` included: they are not JSON, and Python's
parser would pass them on as floats), nesting deeper than any request needs (the parser's own
recursion limit would otherwise surface as an internal error), integers longer than Python
converts (4,300 digits), a body that is not an object, and strings, keys included, holding a
lone surrogate (``"\\ud800"`` is valid JSON, but no UTF-8 encoder, tokenizer or log line takes
it). NUL and other control characters are left to the field checks: they are text to a
tokenizer, and only some fields refuse them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

MAX_DEPTH = 16  # containers inside containers; a chat request needs 5 (content parts' text)


class InvalidBody(ValueError):
    """The body as a whole is unusable; `param` names the field when one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def decode_body(data: bytes) -> dict[str, Any]:
    """The body as a JSON object whose strings all encode to UTF-8, at most MAX_DEPTH deep."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidBody(f"the body is not UTF-8: {error.reason} at byte {error.start}") from None
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_int=_integer)
    except RecursionError:
        raise InvalidBody(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as error:
        raise InvalidBody(f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise InvalidBody("the body must be a JSON object")
    _check_values(body)
    return body


def _no_constant(name: str) -> float:
    raise InvalidBody(f"the body is not valid JSON: {name} is not a JSON number")


def _integer(literal: str) -> int:
    digits = len(literal.lstrip("-"))
    if digits > sys.get_int_max_str_digits():
        raise InvalidBody(f"the body holds an integer of {digits} digits: no field takes one")
    return int(literal)


def _check_values(body: dict[str, Any]) -> None:
    """Every string (keys too) encodes to UTF-8, and no container is deeper than MAX_DEPTH;
    walked with a stack, not recursion, so no body can exhaust the interpreter's."""
    # (value, its path, its depth, the top-level field it is in: what a nesting error names)
    stack: list[tuple[object, str, int, str]] = [(body, "", 1, "")]
    while stack:
        value, path, depth, field = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_DEPTH:
            where = _printable(field)
            raise InvalidBody(f"{where}: nests deeper than {MAX_DEPTH} levels", where)
        if isinstance(value, dict):
            for key, item in value.items():
                inner = f"{path}.{key}" if path else key
                _check_text(key, inner)
                stack.append((item, inner, depth + 1, field or key))
        else:
            stack.extend((item, f"{path}[{i}]", depth + 1, field) for i, item in enumerate(value))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = _printable(path)
        raise InvalidBody(
            f"{where or 'body'}: character {error.start} is a lone surrogate "
            f"({text[error.start]!r}): send valid UTF-8 text (escaped pairs are fine)",
            where or None,
        ) from None


def _printable(path: str, limit: int = 200) -> str:
    """A path as the error names it: keys may hold anything (a surrogate, a megabyte), and
    the answer must encode and stay short."""
    shown = path.encode("ascii", "backslashreplace").decode("ascii")
    return shown if len(shown) <= limit else shown[:limit] + "..."

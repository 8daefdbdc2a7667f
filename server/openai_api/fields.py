"""Typed reads of one JSON field, strict as JSON types are: true is not 1 (nor 0 false), an
integer field takes no float, numbers are finite and within 64 bits. Each refusal is an
InvalidParameter naming the field, with the value quoted short, whatever the client sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from kenspec.server.engine.params import InvalidParameter

MAX_NAME = 256  # characters of `model` and `user`: ids, not text
MAX_INT = 2**63 - 1  # the largest integer any field takes (seeds are 64-bit)


def absent_or(*allowed: object) -> Callable[[object], bool]:
    """Absent, or one of `allowed` as JSON types it: true is not 1, 0 is not false."""

    def check(value: object) -> bool:
        return value is None or any(_same(value, one) for one in allowed)

    return check


def _same(value: object, allowed: object) -> bool:
    return isinstance(value, bool) == isinstance(allowed, bool) and value == allowed


def name_field(body: Mapping[str, Any], name: str) -> str | None:
    """An id-like string field: absent (None), or 1 to MAX_NAME characters."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAME:
        raise InvalidParameter(name, f"must be a string of 1 to {MAX_NAME} characters")
    return value


def number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    # (an integer past a float's range, 1 and 400 zeros, is not finite either)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_INT:
        return float(value)
    if not isinstance(value, float) or not math.isfinite(value):
        raise InvalidParameter(name, f"must be a finite number, not {shown(value)}")
    return value


def integer(body: Mapping[str, Any], name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise InvalidParameter(name, f"must be an integer in [{minimum}, 2^63), not {shown(value)}")
    return value


def boolean(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParameter(name, f"must be true or false, not {shown(value)}")
    return value


def key(name: str, limit: int = 64) -> str:
    """An unknown key as an error names it: a client may send a megabyte of one."""
    return name if len(name) <= limit else name[:limit] + "..."


def shown(value: object, limit: int = 64) -> str:
    """A value as an error message quotes it: short, whatever the client sent."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

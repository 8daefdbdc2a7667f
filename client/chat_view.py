"""How `kenspec chat` shows an answer: the streamed text on stdout and, on a terminal, a status
line redrawn under it after each round (mode, tokens/s, accepted/drafted, tokens) that stays as
the answer's summary line.
"""

from __future__ import annotations

import os
from typing import TextIO

from kenspec.api.outputs import Mode

from .stats import StreamStats

# ANSI/VT100 sequences for the live status line. IND/RI move down/up one line keeping the
# column (IND scrolls at the bottom), so a line below the answer is reserved without losing
# the cursor's place in the answer; ESC 7/8 save and restore that place.
_RESERVE_LINE = "\x1bD\x1bM"
_SAVE, _RESTORE, _DOWN = "\x1b7", "\x1b8", "\x1bD"
_ERASE_LINE, _ERASE_BELOW = "\r\x1b[2K", "\x1b[J"
_DIM, _NORMAL = "\x1b[2m", "\x1b[0m"


def mode_label(mode: str | None, speculation: str) -> str:
    """How the rounds are decoded: OFF when asked for plain decoding, else as they report it."""
    if speculation == "off":
        return "OFF"
    if mode == Mode.SPECULATIVE:
        return "speculative"
    if mode == Mode.AUTOREGRESSIVE:
        return "fallback"  # the request's breaker stopped drafting (or there was nothing to draft)
    return mode or "-"


def status_line(stats: StreamStats, speculation: str, now: float) -> str:
    """E.g. ``speculative | 41.2 tok/s | accepted 30/40 (75%) | 57 tokens``, plus the finish
    reason once there is one."""
    elapsed = now - stats.started
    rate = f"{stats.tokens / elapsed:.1f}" if elapsed > 0 else "-"
    share = f" ({stats.accepted / stats.drafted:.0%})" if stats.drafted else ""
    parts = [mode_label(stats.last_mode, speculation), f"{rate} tok/s"]
    parts += [f"accepted {stats.accepted}/{stats.drafted}{share}", f"{stats.tokens} tokens"]
    if stats.finish_reason is not None:
        parts.append(str(stats.finish_reason))
    return " | ".join(parts)


class AnswerView:
    """Writes one streaming answer to `out` and its status to `err`: on a terminal (`live`)
    the status is redrawn on the line below the answer after each round; otherwise only the
    final status is written, as a plain line."""

    def __init__(self, out: TextIO, err: TextIO, live: bool) -> None:
        self._out, self._err, self._live = out, err, live
        self._ends_line = True  # what was written so far ends with a newline

    def write(self, text: str) -> None:
        if not text:
            return
        if self._live:
            self._emit(self._err, _ERASE_BELOW)
        self._emit(self._out, text)
        self._ends_line = text.endswith("\n")

    def status(self, line: str) -> None:
        if self._live:
            line = line[: _width(self._err) - 3]  # one row: a wrapped line would not be erased
            redraw = f"{_RESERVE_LINE}{_SAVE}{_DOWN}{_ERASE_LINE}{_DIM}[{line}]{_NORMAL}{_RESTORE}"
            self._emit(self._err, redraw)

    def end(self, summary: str) -> None:
        """Close the answer's line and leave `summary` on the next one."""
        if self._live:
            self._emit(self._err, _ERASE_BELOW)
        if not self._ends_line:
            self._emit(self._out, "\n")
        self._emit(self._err, f"{summary}\n")

    @staticmethod
    def _emit(stream: TextIO, text: str) -> None:
        stream.write(text)
        stream.flush()


def _width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80  # 0: size never set
    except (OSError, ValueError):
        return 80

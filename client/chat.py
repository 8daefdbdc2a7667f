"""`kenspec chat`: a multi-turn chat with a kenspec server in the terminal.

Each answer is one Generate call that carries the whole conversation as chat messages (system
prompt, earlier turns, the new question), so the server's prefix cache reuses the earlier turns
instead of prefilling them again. The answer streams as the verification rounds arrive; on a
terminal a status line under it shows the speed, the acceptance so far and the decoding mode,
and stays as a summary line once the answer ends.

Ctrl-C during an answer cancels that call only: its question and partial answer are dropped
from the conversation, so the history holds only complete exchanges. Ctrl-C at an empty prompt,
Ctrl-D or /quit leave. With stdin not a terminal (piped), each line is one question (commands
work too), answers go to stdout one after another, each ended by a newline, and the summary
lines go to stderr without any redraw; nobody is typing there, so a failed call ends the
session with exit code 1 and Ctrl-C stops it (exit 130), as they do for `kenspec`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

from .chat_view import AnswerView, status_line
from .errors import KenspecError, ProtocolError
from .request import ChatTurn, GenerateOptions
from .results import Round
from .stats import StreamStats
from .sync_client import Client, RoundStream

PROMPT = "> "
COMMANDS = """\
  /reset          clear the conversation (the system prompt stays)
  /system [TEXT]  set the system prompt; without TEXT, clear it
  /help           this list
  /quit, /exit    leave (so do Ctrl-D and Ctrl-C at an empty prompt)
Ctrl-C during an answer stops it; its question and partial answer are dropped.
Start a line with // to send it beginning with a single /."""
CANCELLED = "[cancelled: the question and its partial answer are dropped from the conversation]"


@dataclass(slots=True)
class Conversation:
    """The system prompt and the complete exchanges so far, as the server will see them."""

    system: str = ""
    turns: list[tuple[str, str]] = field(default_factory=list)  # user, assistant, user, ...

    def messages(self, question: str) -> list[ChatTurn]:
        """What to send for `question`: the system prompt (if any), history, the question."""
        system: list[ChatTurn] = [("system", self.system)] if self.system else []
        return [*system, *self.turns, ("user", question)]

    def record(self, question: str, answer: str) -> None:
        self.turns += [("user", question), ("assistant", answer)]


@dataclass(frozen=True, slots=True)
class Line:
    """One input line read as a command (`command` without its /) or as text to send."""

    command: str | None
    text: str


def parse_line(line: str) -> Line:
    """
    >>> parse_line("/system  be brief ")
    Line(command='system', text='be brief')
    >>> parse_line("//etc/hosts?")
    Line(command=None, text='/etc/hosts?')
    """
    stripped = line.strip()
    if stripped.startswith("//"):
        return Line(None, stripped[1:])
    if not stripped.startswith("/"):
        return Line(None, stripped)
    name, _, argument = stripped[1:].partition(" ")
    return Line(name, argument.strip())


class ChatSession:
    """The read-answer loop over one client; `run()` returns the exit code."""

    def __init__(
        self,
        client: Client,
        options: GenerateOptions,
        *,
        system: str,
        stdin: TextIO,
        out: TextIO,
        err: TextIO,
    ) -> None:
        self.client, self.options = client, options
        self.conversation = Conversation(system)
        self._stdin, self._out, self._err = stdin, out, err
        self._interactive = stdin.isatty()
        self._live = self._interactive and err.isatty() and os.environ.get("TERM") != "dumb"
        self._speculation = options.get("speculation", "auto")

    def run(self, model: str) -> int:
        """Read and answer until the input ends or the user leaves; `model` is for the banner."""
        if self._interactive:
            _enable_line_editing()
            self._note(f"kenspec chat with {model} at {self.client.address}")
            self._note("/help lists the commands; Ctrl-D leaves")
        while True:
            try:
                line = self._read()
                if line is None:
                    return 0
                if (code := self._handle(line)) is not None:
                    return code
            except KeyboardInterrupt:
                if not self._interactive:
                    raise  # nobody is typing: Ctrl-C stops the chat, as it stops `kenspec`
                self._end_line()  # a Ctrl-C between an answer and the prompt: back to it

    def _handle(self, line: str) -> int | None:
        """Act on one input line; the exit code once the session should end."""
        parsed = parse_line(line)
        if parsed.command is not None:
            return None if self._command(parsed) else 0
        if parsed.text and not self._answer(parsed.text) and not self._interactive:
            return 1  # a script reading the answers must learn that one is missing
        return None

    def _read(self) -> str | None:
        """The next line; None at the end of input or on Ctrl-C at an empty prompt."""
        if not self._interactive:
            line = self._stdin.readline()
            return line.removesuffix("\n") if line else None
        try:
            return input(PROMPT)  # the process's own terminal, with readline's editing
        except EOFError:
            self._end_line()
            return None
        except KeyboardInterrupt:
            typed = _typed_so_far()
            self._end_line()
            return "" if typed else None  # Ctrl-C on a typed line only clears it

    def _command(self, line: Line) -> bool:
        """Run a /command; False when the session should end."""
        if line.command in ("quit", "exit"):
            return False
        if line.command == "reset":
            self.conversation.turns.clear()
            self._note("[conversation cleared]")
        elif line.command == "system":
            self.conversation.system = line.text
            self._note(f"[system prompt: {line.text}]" if line.text else "[system prompt cleared]")
        elif line.command == "help":
            self._note(COMMANDS)
        else:
            self._note(f"unknown command /{line.command}; /help lists the commands")
        return True

    def _answer(self, question: str) -> bool:
        """Stream the answer to `question` and record the exchange once it is complete;
        False when the call failed."""
        view = AnswerView(self._out, self._err, self._live)
        stats = StreamStats(started=time.perf_counter())
        try:
            answer = self._stream(question, view, stats)
        except KeyboardInterrupt:
            if not self._interactive:
                raise
            view.end(CANCELLED)
            return True
        except KenspecError as error:
            view.end(f"error: {error}")
            return False
        view.end(f"[{status_line(stats, self._speculation, stats.last_seen)}]")
        self.conversation.record(question, answer)
        return True

    def _stream(self, question: str, view: AnswerView, stats: StreamStats) -> str:
        """The answer's text, shown as it arrives. A reader thread runs the call; this (the
        main) thread only waits for its rounds, so a Ctrl-C never lands inside gRPC's own code,
        where it could leave one of the call's locks held and stall every later call."""
        messages = self.conversation.messages(question)
        rounds = self.client.generate(None, messages, **self.options)
        arrived: queue.SimpleQueue[Round | BaseException | None] = queue.SimpleQueue()
        with _ctrl_c_to_main_thread():
            threading.Thread(target=_read_rounds, args=(rounds, arrived), daemon=True).start()
        parts: list[str] = []
        try:
            while (round_ := arrived.get()) is not None:
                if isinstance(round_, BaseException):
                    raise round_
                stats.observe(round_, time.perf_counter())
                parts.append(round_.text)
                view.write(round_.text)
                view.status(status_line(stats, self._speculation, time.perf_counter()))
        finally:
            with _ctrl_c_to_main_thread():  # a Ctrl-C meanwhile arrives after the cancel
                rounds.cancel()  # if it is still running (Ctrl-C, an error); else a no-op
        if stats.finish_reason is None:
            raise ProtocolError(
                None, "the stream ended without a finish_reason", self.client.address
            )
        return "".join(parts)

    def _end_line(self) -> None:
        self._out.write("\n")
        self._out.flush()

    def _note(self, text: str) -> None:
        self._err.write(f"{text}\n")
        self._err.flush()


def run_chat(
    connect: Callable[[], Client],
    options: GenerateOptions,
    *,
    system: str,
    stdin: TextIO,
    out: TextIO,
    err: TextIO,
) -> int:
    """Connect with `connect()` and chat until the user leaves; returns the exit code.
    A server that does not answer fails here, before any typing."""
    with contextlib.ExitStack() as stack:
        with _ctrl_c_to_main_thread():  # gRPC starts its threads with the channel and first call
            client = stack.enter_context(connect())
            model = client.model_info().model
        session = ChatSession(client, options, system=system, stdin=stdin, out=out, err=err)
        return session.run(model)


@contextlib.contextmanager
def _ctrl_c_to_main_thread() -> Iterator[None]:
    """Inside, SIGINT waits: threads started here never take it (they inherit the mask), and a
    Ctrl-C meanwhile arrives on leaving. The prompt blocks the main thread in readline, which
    only a signal to that thread wakes: a Ctrl-C the kernel handed to one of gRPC's threads
    would wait there until the next key."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no per-thread signals
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a Ctrl-C meanwhile arrives now


def _read_rounds(
    rounds: RoundStream, arrived: queue.SimpleQueue[Round | BaseException | None]
) -> None:
    """Hand each round to the main thread, then None at the end or the error that ended it."""
    try:
        for round_ in rounds:
            arrived.put(round_)
    except BaseException as error:  # the main thread raises it
        arrived.put(error)
    else:
        arrived.put(None)


def _enable_line_editing() -> None:
    """Arrow keys and history for input(), where the platform has readline."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (importing it is what turns it on)


def _typed_so_far() -> str:
    """What was on the prompt line when Ctrl-C came; "" when unknown (no readline)."""
    try:
        import readline
    except ImportError:
        return ""
    return readline.get_line_buffer()

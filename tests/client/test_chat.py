"""`kenspec chat`: the pure parts alone, piped input in-process, and a real session on a
pseudo-terminal (typed lines, Ctrl-C, Ctrl-D) against the fake server and the tiny model.

No verdict waits on time: each step waits for content (a prompt, an answer, a note) and the
deadlines only bound waits that a passing run never reaches.
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from conftest import FakeGenerator, ThreadedFake

from kenspec.api import generator_pb2 as pb
from kenspec.client import Client
from kenspec.client.chat import Conversation, Line, parse_line
from kenspec.client.chat_view import mode_label, status_line
from kenspec.client.cli import main
from kenspec.client.results import Round
from kenspec.client.stats import StreamStats

ROOT = Path(__file__).resolve().parents[2]  # the repository, where `client` lives
DEADLINE = 60.0  # seconds; bounds waits that a passing run never reaches
TIMEOUT = ["--timeout", "30"]  # no answer can hang a test
CANCELS = 60  # Ctrl-Cs in one session
STATUS = r"\[speculative \| [\d.]+ tok/s \| accepted 4/6 \(67%\) \| 7 tokens \| length\]"


class ChatFake(FakeGenerator):
    """The client tests' fake, keyed on the last chat message instead of the raw prompt: the
    answer is "Hello <question>", and "__endless__" / "__invalid__" misbehave as there."""

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        question = request.messages.messages[-1].content
        if question in ("__endless__", "__invalid__"):
            request = pb.GenerateRequest(prompt=question)  # recorded as this stand-in
        async for response in super().Generate(request, context):
            yield response


@pytest.fixture
def chat_fake() -> Iterator[tuple[str, ChatFake]]:
    servicer = ChatFake()
    runner = ThreadedFake(servicer)
    address = runner.start()
    yield address, servicer
    runner.stop()


def turns(request: pb.GenerateRequest | pb.TokenizeRequest) -> list[tuple[str, str]]:
    assert isinstance(request, pb.GenerateRequest)
    return [(m.role, m.content) for m in request.messages.messages]


# -- pure parts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        ("hello there ", Line(None, "hello there")),
        ("/reset", Line("reset", "")),
        ("/system  Answer in French. ", Line("system", "Answer in French.")),
        ("/system", Line("system", "")),
        ("/nonsense x", Line("nonsense", "x")),
        ("//etc/hosts", Line(None, "/etc/hosts")),
        ("", Line(None, "")),
    ],
)
def test_parse_line(line: str, parsed: Line) -> None:
    assert parse_line(line) == parsed


def test_conversation_sends_system_history_then_question() -> None:
    conversation = Conversation("be brief")
    conversation.record("hi", "hello")

    assert conversation.messages("and?") == [
        ("system", "be brief"),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "and?"),
    ]
    assert Conversation().messages("hi") == [("user", "hi")]


@pytest.mark.parametrize(
    ("mode", "speculation", "label"),
    [
        ("speculative", "auto", "speculative"),
        ("autoregressive", "auto", "fallback"),
        ("autoregressive", "off", "OFF"),
    ],
)
def test_mode_label(mode: str, speculation: str, label: str) -> None:
    assert mode_label(mode, speculation) == label


def test_status_line_counts_acceptance_and_speed() -> None:
    stats = StreamStats(started=10.0)
    response = pb.GenerateResponse(
        token_ids=[1, 2, 3, 4],
        round=pb.RoundInfo(drafted=4, accepted=3, mode=pb.ROUND_MODE_SPECULATIVE),
    )
    stats.observe(Round.from_proto(response), 12.0)

    line = status_line(stats, "auto", 12.0)
    assert line == "speculative | 2.0 tok/s | accepted 3/4 (75%) | 4 tokens"


# -- piped input, in-process ------------------------------------------------------------------


def chat(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    address: str,
    stdin: str,
    *flags: str,
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["chat", "-a", address, *TIMEOUT, *flags])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err


def test_piped_turns_carry_the_history(
    chat_fake: tuple[str, ChatFake],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, fake = chat_fake
    code, out, err = chat(monkeypatch, capsys, address, "first\n\nsecond\n")

    assert code == 0
    assert out == "Hello first\nHello second\n"
    assert re.fullmatch(f"{STATUS}\n{STATUS}\n", err), err  # no banner, no redraw codes
    first, second = fake.requests
    assert turns(first) == [("user", "first")]
    assert turns(second) == [("user", "first"), ("assistant", "Hello first"), ("user", "second")]


def test_system_and_reset_shape_what_is_sent(
    chat_fake: tuple[str, ChatFake],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, fake = chat_fake
    lines = ["q1", "/system be kind", "q2", "/reset", "q3", "/system", "//q4", "/bogus", "/help"]
    code, out, err = chat(
        monkeypatch, capsys, address, "\n".join(lines), "--system", "be brief", "-n", "5"
    )

    assert code == 0
    assert out == "Hello q1\nHello q2\nHello q3\nHello /q4\n"
    assert [turns(r) for r in fake.requests] == [
        [("system", "be brief"), ("user", "q1")],
        [("system", "be kind"), ("user", "q1"), ("assistant", "Hello q1"), ("user", "q2")],
        [("system", "be kind"), ("user", "q3")],
        [("user", "q3"), ("assistant", "Hello q3"), ("user", "/q4")],
    ]
    assert all(r.stopping.max_new_tokens == 5 for r in fake.requests)
    assert "[conversation cleared]" in err
    assert "unknown command /bogus; /help lists the commands\n" in err
    assert "/system [TEXT]" in err  # /help's list


def test_the_call_runs_off_the_main_thread(
    chat_fake: tuple[str, ChatFake],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The main thread takes every Ctrl-C: it must only wait for rounds, never run the gRPC
    call (an interrupt inside its code can leave a lock held; see the terminal test below)."""
    address, _ = chat_fake
    streaming_threads: list[threading.Thread] = []
    stream = Client._stream

    def recorded(self: Client, *args: Any) -> Iterator[Round]:
        for round_ in stream(self, *args):
            streaming_threads.append(threading.current_thread())
            yield round_

    monkeypatch.setattr(Client, "_stream", recorded)
    code, out, _ = chat(monkeypatch, capsys, address, "one\ntwo\n")

    assert (code, out) == (0, "Hello one\nHello two\n")
    assert streaming_threads
    assert threading.main_thread() not in streaming_threads


def test_piped_quit_stops_reading(
    chat_fake: tuple[str, ChatFake],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, fake = chat_fake
    code, out, _ = chat(monkeypatch, capsys, address, "one\n/quit\ntwo\n")

    assert code == 0
    assert out == "Hello one\n"
    assert len(fake.requests) == 1


def test_piped_server_error_ends_with_exit_1(
    chat_fake: tuple[str, ChatFake],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, fake = chat_fake
    code, out, err = chat(monkeypatch, capsys, address, "one\n__invalid__\nthree\n")

    assert code == 1
    assert out == "Hello one\n"
    assert err.endswith(f"error: INVALID_ARGUMENT: {FakeGenerator.INVALID_MESSAGE}\n")
    assert len(fake.requests) == 2


def test_unreachable_server_exits_1_before_reading(
    dead_address: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = chat(monkeypatch, capsys, dead_address, "hi\n")

    assert (code, out) == (1, "")
    assert err.startswith(f"error: UNAVAILABLE: cannot reach the kenspec server at {dead_address}")


def test_chat_help_lists_flags_and_commands(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["chat", "--help"])
    out = capsys.readouterr().out

    assert code == 0
    expected = "usage: kenspec chat --system --address --tls --token --timeout --temperature"
    expected += " --max-new-tokens --stop --speculation --num-draft-tokens /reset /system /help"
    expected += " /quit Ctrl-C"
    assert [word for word in expected.split() if word not in out] == []


def test_piped_ctrl_c_stops_the_chat(chat_fake: tuple[str, ChatFake]) -> None:
    """Nobody types into a pipe: Ctrl-C (SIGINT) cancels the call and ends the chat, exit 130."""
    address, fake = chat_fake
    command = [
        sys.executable,
        "-c",
        FOREGROUND,
        "-m",
        "kenspec.client",
        "chat",
        "-a",
        address,
        *TIMEOUT,
    ]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen(command, cwd=ROOT, **pipes) as process:  # type: ignore[call-overload]
        process.stdin.write(b"__endless__\nnever sent\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], DEADLINE)
        assert ready and os.read(process.stdout.fileno(), 1) == b"."  # the answer is streaming
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=DEADLINE)

    assert process.returncode == 130, err
    assert err.decode().endswith("error: CANCELLED: interrupted\n")
    assert len(fake.requests) == 1  # the next line was not sent


# -- a terminal -------------------------------------------------------------------------------

# Make the pseudo-terminal the child's controlling terminal, as a shell would, so that Ctrl-C
# typed into it reaches the child as SIGINT; then become `python -m client chat`.
LAUNCH = (
    "import fcntl, os, signal, sys, termios; os.setsid(); fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'kenspec.client', 'chat', *sys.argv[1:]])"
)
# A foreground command gets SIGINT's default disposition from the shell; a test runner started
# as a background job (`cmd &` without job control) ignores SIGINT, and its children would
# inherit that. So each chat starts with the default, as it would from a terminal.
FOREGROUND = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)
LIVE_STATUS = re.compile(r"\x1b7(.*?)\x1b8", re.DOTALL)  # drawn below the answer, then erased
ANSI = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|[78DM])")


def plain(screen: str) -> str:
    return ANSI.sub("", screen).replace("\r\n", "\n")


class Terminal:
    """`kenspec chat` on a pseudo-terminal. `text` is what stays on the screen: the output with
    the live status redraws and the ANSI codes taken out; `live_statuses` are the redraws."""

    def __init__(self, *flags: str) -> None:
        self._master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
        self.process = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, *TIMEOUT, *flags],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=ROOT,
            env={**os.environ, "TERM": "xterm"},
        )
        os.close(slave)
        self.raw = b""
        self._seen = 0  # expect() searches the text after its last match

    @property
    def text(self) -> str:
        return plain(LIVE_STATUS.sub("", self.raw.decode(errors="replace")))

    @property
    def live_statuses(self) -> list[str]:
        return [plain(s).strip() for s in LIVE_STATUS.findall(self.raw.decode(errors="replace"))]

    def type(self, keys: str) -> None:
        os.write(self._master, keys.encode())

    def prompt(self, before: str = "") -> re.Match[str]:
        """Wait for `before` then the prompt, and for readline to take the terminal (it turns
        canonical mode off): keys typed earlier would meet the kernel's line editing instead
        (Ctrl-D would queue an end of file that readline then reads as a NUL)."""
        match = self.expect(f"{before}\n> ")
        self._wait_until(
            lambda: not termios.tcgetattr(self._master)[3] & termios.ICANON, "readline's mode"
        )
        self.wait_idle()
        return match

    def wait_idle(self) -> None:
        """Wait until the child's main thread sleeps (in readline's wait for a key). A signal
        that lands just before that wait begins is only seen at the next key (CPython's
        readline loop), a window that a person never hits and a test easily does."""
        stat = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/stat")
        self._wait_until(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "S", "sleep")

    def _wait_until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not condition():
            if time.monotonic() > deadline or not self._read(0.01):
                raise AssertionError(f"the chat never reached {what}")

    def expect(self, pattern: str) -> re.Match[str]:
        """The first match of `pattern` in what appeared since the last expect()."""
        deadline = time.monotonic() + DEADLINE
        while (match := re.compile(pattern).search(self.text, self._seen)) is None:
            if time.monotonic() > deadline or not self._read(deadline - time.monotonic()):
                raise AssertionError(f"{pattern!r} never appeared in:\n{self.text[self._seen :]}")
        self._seen = match.end()
        return match

    def exit_code(self) -> int:
        deadline = time.monotonic() + DEADLINE
        # Drain, so the child never blocks on a full terminal, until it closes it.
        while self._read(deadline - time.monotonic()) and time.monotonic() < deadline:
            pass
        try:
            return self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit; the screen since:\n{self.text[self._seen :]}") from None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=DEADLINE)
        os.close(self._master)

    def _read(self, timeout: float) -> bool:
        """Read what comes within `timeout`; False once the child has closed the terminal."""
        ready, _, _ = select.select([self._master], [], [], max(timeout, 0))
        if not ready:
            return True
        try:
            data = os.read(self._master, 65536)
        except OSError:  # EIO: the child exited and the terminal closed
            return False
        self.raw += data
        return bool(data)


def threads_taking_sigint(pid: int) -> list[int]:
    """The threads of process `pid` that do not block SIGINT (Linux /proc)."""
    taking = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        blocked = re.search(r"SigBlk:\s*([0-9a-f]+)", (task / "status").read_text())
        assert blocked is not None
        if not int(blocked.group(1), 16) & (1 << (signal.SIGINT - 1)):
            taking.append(int(task.name))
    return taking


@pytest.fixture
def terminal() -> Iterator[Callable[..., Terminal]]:
    started: list[Terminal] = []

    def start(*flags: str) -> Terminal:
        started.append(Terminal(*flags))
        return started[-1]

    yield start
    for term in started:
        term.close()


def test_terminal_streams_with_a_live_status_and_keeps_history(
    chat_fake: tuple[str, ChatFake], terminal: Callable[..., Terminal]
) -> None:
    address, fake = chat_fake
    term = terminal("-a", address, "--system", "be brief")
    term.prompt(f"kenspec chat with fake at {re.escape(address)}\n/help lists the commands.*")
    term.type("first\r")
    term.prompt(f"first\nHello first\n{STATUS}")
    term.type("second\r")
    term.prompt(f"second\nHello second\n{STATUS}")
    term.type("\x04")  # Ctrl-D

    assert term.exit_code() == 0
    live = r"\[(speculative|fallback) \| [\d.]+ tok/s \| accepted (\d+/\d+).* (\d+) tokens.*\]"
    drawn = [re.fullmatch(live, status) for status in term.live_statuses]
    assert all(drawn), term.live_statuses
    # One redraw per round, as the rounds came: drafting, the breaker's fallback, drafting.
    assert [m.groups() for m in drawn if m] == [
        ("speculative", "3/4", "4"),
        ("fallback", "3/4", "5"),
        ("speculative", "4/6", "7"),
    ] * 2
    assert turns(fake.requests[1]) == [
        ("system", "be brief"),
        ("user", "first"),
        ("assistant", "Hello first"),
        ("user", "second"),
    ]


def test_ctrl_c_cancels_the_answer_not_the_session(
    chat_fake: tuple[str, ChatFake], terminal: Callable[..., Terminal]
) -> None:
    address, fake = chat_fake
    term = terminal("-a", address)
    term.prompt()
    term.type("first\r")
    term.prompt(STATUS)
    # The kernel hands a Ctrl-C to any thread that takes SIGINT; only the main thread's wakes
    # the prompt, so gRPC's threads must not take it.
    assert threads_taking_sigint(term.process.pid) == [term.process.pid]
    term.type("__endless__\r")
    term.expect(r"\.\.\.")  # the answer is streaming
    term.type("\x03")
    term.prompt(r"\[cancelled: the question and its partial answer are dropped.*\]")
    assert fake.cancelled.wait(DEADLINE)  # the server saw the call cancelled
    term.type("typed but not sent")
    term.expect("typed but not sent")  # readline has it
    term.wait_idle()
    term.type("\x03")  # Ctrl-C on a typed line clears it
    term.prompt()
    term.type("next\r")
    term.prompt(f"Hello next\n{STATUS}")
    term.type("\x03")  # Ctrl-C at an empty prompt leaves

    assert term.exit_code() == 0
    sent = [turns(r) for r in fake.requests]
    assert sent[-1] == [("user", "first"), ("assistant", "Hello first"), ("user", "next")]
    assert len(sent) == 3


def test_ctrl_c_again_and_again_leaves_every_later_call_answering(
    chat_fake: tuple[str, ChatFake], terminal: Callable[..., Terminal]
) -> None:
    """A Ctrl-C lands wherever the main thread is. Inside gRPC's own code it could leave one of
    a call's locks held, and the channel's thread then stalled every later call (about one
    cancel in thirty here): each cancel is followed by a question that must be answered."""
    address, fake = chat_fake
    term = terminal("-a", address)
    term.prompt()
    for question in range(CANCELS):
        term.type("__endless__\r")
        term.expect(r"\.\.\.")  # the answer is streaming
        term.type("\x03")
        term.prompt(r"\[cancelled: the question and its partial answer are dropped.*\]")
        term.type(f"q{question}\r")
        term.prompt(f"Hello q{question}\n{STATUS}")
    term.type("\x04")

    assert term.exit_code() == 0
    assert [turns(r)[-1] for r in fake.requests[1::2]] == [
        ("user", f"q{question}") for question in range(CANCELS)
    ]


def test_terminal_commands(
    chat_fake: tuple[str, ChatFake], terminal: Callable[..., Terminal]
) -> None:
    address, fake = chat_fake
    term = terminal("-a", address)
    term.prompt()
    term.type("/help\r")
    term.prompt(r"/reset +clear the conversation(.|\n)*")
    term.type("/oops\r")
    term.prompt(r"unknown command /oops; /help lists the commands")
    term.type("/system speak softly\r")
    term.prompt(r"\[system prompt: speak softly\]")
    term.type("hi\r")
    term.prompt(f"Hello hi\n{STATUS}")
    term.type("/quit\r")

    assert term.exit_code() == 0
    assert [turns(r) for r in fake.requests] == [[("system", "speak softly"), ("user", "hi")]]


# -- the tiny model -----------------------------------------------------------------------------


def test_tiny_model_answers_follow_the_conversation(
    tiny_server: Callable, terminal: Callable[..., Terminal]
) -> None:
    """Against a real server: the second answer on screen is the model's greedy answer to the
    whole conversation (computed here with the plain client), so the history went with it."""
    server = tiny_server()
    address = f"127.0.0.1:{server.port}"
    term = terminal("-a", address, "-n", "6", "--ignore-eos")
    term.prompt()
    answer = r"(?s)(.*?)\n\[(speculative|fallback) \| [^\n]* \| 6 tokens \| length\]"
    term.type("The quick brown fox\r")
    term.expect("The quick brown fox\n")
    first = term.prompt(answer)
    term.type("Hello world\r")
    term.expect("Hello world\n")
    second = term.prompt(answer)
    term.type("\x04")

    assert term.exit_code() == 0
    with Client(address, timeout=DEADLINE) as client:
        history = [("user", "The quick brown fox")]
        expected_first = client.generate_text(None, history, max_new_tokens=6, ignore_eos=True)
        history += [("assistant", expected_first.text), ("user", "Hello world")]
        expected_second = client.generate_text(None, history, max_new_tokens=6, ignore_eos=True)
        alone = client.generate_text(None, history[-1:], max_new_tokens=6, ignore_eos=True)
    server.stop()
    assert alone.text != expected_second.text  # else the screen could not show the history
    # The screen shows the text with one newline added unless the answer ended with one.
    assert first.group(1) == expected_first.text.removesuffix("\n")
    assert second.group(1) == expected_second.text.removesuffix("\n")

"""`kenspec`: run a server, or stream a generation from one to the terminal.

    kenspec serve                      # the server (`kenspec serve --help`; also kenspec-server)
    kenspec generate "Once upon a time" -n 64
    kenspec "Once upon a time" -n 64   # `generate` is the default command
    echo "Tell me a joke" | kenspec --chat --temperature 0.7
    kenspec --info
    kenspec chat --system "Answer briefly."

Text goes to stdout as it arrives; one statistics line goes to stderr at the end. Errors print
``error: <CODE>: <message>`` and exit 2 (bad usage) or 1 (server or connection failure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from .channel import DEFAULT_ADDRESS, TOKEN_ENV
from .chat import COMMANDS, run_chat
from .errors import KenspecError, ProtocolError
from .request import ChatTurn, GenerateOptions
from .results import Round, completions_from_rounds
from .session_affinity import new_session_id
from .stats import StreamStats
from .sync_client import Client

ADDRESS_ENV = "KENSPEC_ADDRESS"
EXIT_SERVER_ERROR = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with the command line itself (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: INVALID_ARGUMENT: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kenspec",
        description="Generate text with a kenspec speculative-decoding server.",
        epilog="Commands: `kenspec serve` runs a server (see `kenspec serve --help`), "
        "`kenspec chat` starts an interactive chat (see `kenspec chat --help`), "
        "`kenspec generate` (the default) is this one. "
        f"Environment: {ADDRESS_ENV} (default --address), {TOKEN_ENV} (default --token).",
    )
    parser.add_argument(
        "prompt",
        nargs="?",
        help="the prompt; '-' or absent reads it from stdin (one trailing newline dropped); "
        "to send the word chat itself, write `-- chat`",
    )
    _add_connection_flags(parser)
    _add_input_flags(parser)
    _add_sampling_flags(parser)
    _add_speculation_flags(parser)
    _add_format_flags(parser)
    return parser


def build_chat_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kenspec chat",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Chat with a kenspec server: multi-turn, streamed, with a live status line "
        "(mode, tokens/s, accepted/drafted). With stdin piped, each line is one question.",
        epilog=f"Commands inside the chat:\n{COMMANDS}",
    )
    parser.add_argument("--system", default="", metavar="TEXT", help="initial system prompt")
    parser.set_defaults(request_id="")  # each answer is its own request; the server names it
    _add_connection_flags(parser)
    _add_sampling_flags(parser)
    _add_speculation_flags(parser)
    return parser


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument(
        "-a",
        "--address",
        action="append",
        metavar="HOST:PORT",
        help="server address; repeat or comma-separate several to balance round-robin "
        f"(default: ${ADDRESS_ENV} or {DEFAULT_ADDRESS})",
    )
    group.add_argument("--token", help=f"bearer token to send (default: ${TOKEN_ENV})")
    group.add_argument("--tls", action="store_true", help="use TLS with the system root CAs")
    group.add_argument("--tls-ca", metavar="PEM", help="root CA file; implies --tls")
    group.add_argument("--tls-cert", metavar="PEM", help="client certificate for mTLS")
    group.add_argument("--tls-key", metavar="PEM", help="client private key for mTLS")
    group.add_argument(
        "--tls-server-name", metavar="NAME", help="name to verify the server certificate against"
    )
    group.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="deadline of the whole call, stream included",
    )
    group.add_argument(
        "--session-id",
        metavar="ID",
        help="send as x-session-id metadata so a balancer (nginx, or this client over several "
        "addresses) keeps these calls on one replica and its prefix cache "
        "(kenspec chat: a new one per chat unless given)",
    )


def _add_input_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("input and output")
    group.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (chat template)"
    )
    group.add_argument("--system", metavar="TEXT", help="system message; implies --chat")
    group.add_argument(
        "--json", action="store_true", help="print each round as one JSON object per line"
    )
    mode = group.add_mutually_exclusive_group()
    mode.add_argument(
        "--tokenize", action="store_true", help="print the prompt's tokens as JSON and exit"
    )
    mode.add_argument("--info", action="store_true", help="print the server's model info as JSON")
    group.add_argument("--request-id", default="", help="request id to log and echo")
    group.add_argument(
        "--choices", type=int, default=0, help="answers to generate (n); printed one by one"
    )
    group.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="print each token's log-probability and its K best alternatives (0-20)",
    )


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling and stopping")
    group.add_argument("-t", "--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-k", type=int, default=0, help="0 = no top-k filtering")
    group.add_argument("--top-p", type=float, default=0.0, help="0 or 1 = no nucleus filtering")
    group.add_argument("--seed", type=int, help="random seed (default: the server picks one)")
    group.add_argument(
        "-n", "--max-new-tokens", type=int, default=0, help="0 = the server's default"
    )
    group.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop text; repeatable"
    )
    group.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence"
    )
    group.add_argument("--min-p", type=float, default=0.0, help="0 = no min-p filtering")
    group.add_argument(
        "--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = none"
    )
    group.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = none"
    )
    group.add_argument(
        "--repetition-penalty", type=float, default=0.0, help="CTRL's (> 0); 0 or 1 = none"
    )
    group.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=AMOUNT",
        help="add AMOUNT (-100..100) to token ID's logit; repeatable",
    )


def _add_format_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output (docs/structured-output.md)")
    exclusive = group.add_mutually_exclusive_group()
    exclusive.add_argument("--json-object", action="store_true", help="answer with a JSON object")
    exclusive.add_argument(
        "--json-schema", metavar="FILE|JSON", help="answer with JSON valid for this schema"
    )
    exclusive.add_argument("--regex", metavar="REGEX", help="answer matching this regex")
    exclusive.add_argument("--lark", metavar="FILE", help="answer matching this Lark grammar")


def _response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """The flags' response_format (HTTP-shaped); a schema or grammar from a file if one is
    named, else the text given."""
    if getattr(args, "json_object", False):
        return {"type": "json_object"}
    if getattr(args, "json_schema", None):
        text = _file_or_text(args.json_schema)
        return {"type": "json_schema", "json_schema": {"schema": text}}
    if getattr(args, "regex", None):
        return {"type": "regex", "regex": args.regex}
    if getattr(args, "lark", None):
        return {"type": "lark", "lark": _file_or_text(args.lark)}
    return None


def _file_or_text(value: str) -> str:
    path = Path(value)
    return path.read_text() if not value.lstrip().startswith("{") and path.is_file() else value


def _add_speculation_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculation")
    group.add_argument(
        "--speculation",
        choices=["auto", "off"],
        default="auto",
        help="auto: draft and verify while it pays; off: plain decoding (default: auto)",
    )
    group.add_argument(
        "-k",
        "--num-draft-tokens",
        type=int,
        default=0,
        help="most draft tokens (nodes) a round verifies; 0 = the server's default",
    )
    group.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        help="grow/shrink the draft length with acceptance (default: the server's)",
    )
    group.add_argument(
        "--draft-context",
        action=argparse.BooleanOptionalAction,
        help="also draft from the prompt and output so far (default: the server's)",
    )


SERVER_MISSING = (
    "`kenspec serve` needs the server, which this installation lacks ({missing} is not "
    "installed; the kenspec-client distribution is the client alone): pip install kenspec"
)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    if argv[:1] == ["generate"]:
        argv = argv[1:]  # the default command, named
    chat = argv[:1] == ["chat"]
    try:
        parser = build_chat_parser() if chat else build_parser()
        args = parser.parse_args(argv[1:] if chat else argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        return _chat(args) if chat else _run(args, sys.stdout, sys.stderr)
    except BrokenPipeError:
        # The reader left (`kenspec ... | head`): stop quietly, and keep Python from
        # complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SERVER_ERROR
    except (UsageError, ValueError, OSError) as error:
        print(f"error: INVALID_ARGUMENT: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KenspecError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    except KeyboardInterrupt:
        print("\nerror: CANCELLED: interrupted", file=sys.stderr)
        return 130


def _serve(argv: list[str]) -> int:
    """The server's own command line (kenspec.server.__main__), where it is installed."""
    try:
        from kenspec.server.__main__ import main as serve
    except ImportError as error:
        missing = error.name or "the server"
        if not missing.startswith(("kenspec", "torch", "transformers", "kenlm", "numpy")):
            raise
        print(
            f"error: FAILED_PRECONDITION: {SERVER_MISSING.format(missing=missing)}", file=sys.stderr
        )
        return EXIT_USAGE
    return serve(argv)


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    with _client(args, args.session_id) as client:
        if args.info:
            _print_json(client.model_info(), out, indent=2)
            return 0
        prompt, messages = _input(args)
        if args.tokenize:
            tokens = client.tokenize(prompt, messages, return_tokens=True)
            _print_json(tokens, out, indent=2)
            return 0
        return _generate(client, prompt, messages, args, out, err)


def _chat(args: argparse.Namespace) -> int:
    # One session per chat: every turn reaches the replica that holds the earlier ones.
    session_id = args.session_id or new_session_id()
    return run_chat(
        lambda: _client(args, session_id),
        _generate_options(args),
        system=args.system,
        stdin=sys.stdin,
        out=sys.stdout,
        err=sys.stderr,
    )


def _client(args: argparse.Namespace, session_id: str | None) -> Client:
    addresses = args.address or [os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS]
    return Client(
        addresses,
        token=args.token,
        tls=args.tls,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_server_name=args.tls_server_name,
        timeout=args.timeout,
        session_id=session_id,
    )


def _input(args: argparse.Namespace) -> tuple[str | None, list[ChatTurn] | None]:
    """(prompt, None) for raw text, (None, messages) with --chat/--system."""
    text = args.prompt
    if text is None or text == "-":
        if text is None and sys.stdin.isatty():
            raise UsageError("no prompt: pass one as an argument or pipe it on stdin")
        text = sys.stdin.read().removesuffix("\n")
    if not (args.chat or args.system):
        return text, None
    messages: list[ChatTurn] = [("system", args.system)] if args.system else []
    messages.append(("user", text))
    return None, messages


def _generate(
    client: Client,
    prompt: str | None,
    messages: list[ChatTurn] | None,
    args: argparse.Namespace,
    out: TextIO,
    err: TextIO,
) -> int:
    stats = StreamStats(started=time.perf_counter())
    last_text = "\n"
    rounds: list[Round] = []
    # Text streams as it comes for one choice; several are printed one by one at the end.
    live = not args.json and (args.choices or 1) == 1
    try:
        for round_ in client.generate(prompt, messages, **_generate_options(args)):
            stats.observe(round_, time.perf_counter())
            rounds.append(round_)
            if args.json:
                _print_json(round_.response, out)
            elif live and round_.text:
                out.write(round_.text)
                out.flush()
                last_text = round_.text
    finally:
        # End the line on a terminal so stats or an error do not start mid-line; pipes get
        # the text exactly as generated.
        if not last_text.endswith("\n") and out.isatty():
            out.write("\n")
            out.flush()
    logprobs = args.logprobs is not None
    if not args.json and (not live or logprobs) and stats.finish_reason is not None:
        _print_choices(rounds, live, logprobs, client.address, out)
    print(stats.summary(), file=err)
    if stats.finish_reason is None:
        raise ProtocolError(None, "the stream ended without a finish_reason", client.address)
    return 0


def _print_choices(
    rounds: list[Round], streamed: bool, logprobs: bool, address: str, out: TextIO
) -> None:
    """After the stream: each choice's text (unless it was streamed) and, when asked, a
    table of its tokens' logprobs (token, logprob, then the alternatives)."""
    completions = completions_from_rounds(rounds, address)
    for completion in completions:
        if not streamed:
            out.write(f"--- choice {completion.choice_index} ---\n{completion.text}\n")
        if logprobs:
            which = "" if streamed else f" of choice {completion.choice_index}"
            out.write(f"--- logprobs{which} ---\n")
            for item in completion.logprobs:
                top = "  ".join(f"{alt.token!r} {alt.logprob:.3f}" for alt in item.top)
                out.write(f"{item.token!r}\t{item.logprob:.4f}\t{top}\n")
    out.flush()


def _logit_bias(entries: Sequence[str]) -> dict[int, float]:
    bias = {}
    for entry in entries:
        token, _, amount = entry.partition("=")
        try:
            bias[int(token)] = float(amount)
        except ValueError:
            raise UsageError(f"--logit-bias takes ID=AMOUNT, not {entry!r}") from None
    return bias


def _generate_options(args: argparse.Namespace) -> GenerateOptions:
    return GenerateOptions(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        speculation=args.speculation,
        num_draft_tokens=args.num_draft_tokens,
        adaptive=args.adaptive,
        draft_context=args.draft_context,
        response_format=_response_format(args),
        request_id=args.request_id,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=_logit_bias(args.logit_bias),
        n=getattr(args, "choices", 0),  # (not flags of kenspec chat)
        logprobs=getattr(args, "logprobs", None) is not None,
        top_logprobs=getattr(args, "logprobs", None) or 0,
    )


def _print_json(message: Message, out: TextIO, indent: int | None = None) -> None:
    data = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    out.write(json.dumps(data, indent=indent, ensure_ascii=False) + "\n")
    out.flush()

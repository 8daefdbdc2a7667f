"""`Client`: the kenspec API over a plain (blocking) grpc channel."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, Unpack

import grpc
from google.protobuf.message import Message

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc

from .channel import DEFAULT_ADDRESS, ChannelSpec, Pairs, channel_spec, tls_config
from .errors import from_rpc_error
from .request import ChatTurn, GenerateOptions, build_generate_request, build_tokenize_request
from .results import Completion, Round, completions_from_rounds
from .session_affinity import (
    call_session,
    check_session_id,
    is_down,
    rendezvous_order,
    session_metadata,
)
from .trace_context import trace_metadata

# (address for errors, stub): where a call goes, best first
Routes = list[tuple[str, pb_grpc.GeneratorStub]]


class RoundStream(Iterator[Round]):
    """The rounds of one Generate call as they arrive. ``cancel()`` ends the call from any
    thread, before or during the iteration, which then raises `KenspecError` (CANCELLED);
    ``close()``, like a generator's, from the iterating thread."""

    def __init__(self, rounds: Callable[[RoundStream], Generator[Round, None, None]]) -> None:
        """`rounds(self)` yields the rounds, telling `calling` each call it makes."""
        self._lock = threading.Lock()
        self._call: grpc.Call | None = None
        self._cancelled = False
        self._rounds = rounds(self)

    def __next__(self) -> Round:
        return next(self._rounds)

    def close(self) -> None:
        self._rounds.close()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()  # a no-op once the stream has ended

    def calling(self, call: grpc.Call) -> None:
        """`call` is the one that now carries the rounds."""
        with self._lock:
            self._call = call
            cancelled = self._cancelled
        if cancelled:
            call.cancel()


class Client:
    """Blocking client; use as ``with Client("host:port") as client: ...``.

    Takes the same arguments as `AsyncClient` (see there): one target or several balanced
    round-robin, optional TLS/mTLS, a bearer token (default ``KENSPEC_TOKEN``), a default
    per-call timeout in seconds, a session id for every call (``generate`` and
    ``generate_text`` take their own).
    """

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = None,
        session_id: str | None = None,
    ) -> None:
        tls_settings = tls_config(tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._spec: ChannelSpec = channel_spec(address, tls_settings, token)
        self._timeout = timeout
        self._session_id = check_session_id(session_id)
        self._channel = _open_channel(self._spec, self._spec.target, self._spec.options)
        self._stub = pb_grpc.GeneratorStub(self._channel)
        # one channel per address, opened on a session's first call there (session_affinity.py)
        self._alone: dict[str, tuple[grpc.Channel, pb_grpc.GeneratorStub]] = {}

    @property
    def address(self) -> str:
        return self._spec.address

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        for channel, _ in self._alone.values():
            channel.close()
        self._alone.clear()

    def generate(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        session_id: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> RoundStream:
        """Stream the rounds of one generation as they arrive (see `AsyncClient.generate`,
        and there for the trace context and the session id sent); the call starts at the
        first ``next()``."""
        request = build_generate_request(prompt, messages, **options)
        session = call_session(self._session_id, session_id)
        trace = trace_metadata(traceparent)
        return RoundStream(lambda stream: self._stream(request, timeout, trace, session, stream))

    def generate_text(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        session_id: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion:
        """Run one generation to the end and join its rounds (one choice: n > 1 raises
        ``ValueError``, see generate_choices)."""
        if options.get("n", 0) > 1:
            raise ValueError("n > 1 gives several completions: use generate_choices")
        (completion,) = self.generate_choices(
            prompt,
            messages,
            timeout=timeout,
            traceparent=traceparent,
            session_id=session_id,
            **options,
        )
        return completion

    def generate_choices(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        session_id: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> list[Completion]:
        """Run a generation of `n` choices (sharing one prefill) to the end: one Completion per
        choice, by index; choice i samples with seed + i."""
        stream = self.generate(
            prompt,
            messages,
            timeout=timeout,
            traceparent=traceparent,
            session_id=session_id,
            **options,
        )
        rounds = list(stream)
        return completions_from_rounds(rounds, self.address)

    def tokenize(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        return_tokens: bool = False,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        request = build_tokenize_request(prompt, messages, return_tokens=return_tokens)
        return self._unary("Tokenize", request, timeout)

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return self._unary("GetModelInfo", pb.GetModelInfoRequest(), timeout)

    def _unary(self, method: str, request: Message, timeout: float | None) -> Any:
        routes = self._routes(self._session_id)
        options = self._call_options(timeout, trace_metadata(), self._session_id)
        for index, (address, stub) in enumerate(routes):
            try:
                return getattr(stub, method)(request, **options)
            except grpc.RpcError as error:
                if index + 1 < len(routes) and is_down(error):
                    continue  # this session's address is down: its next one
                raise from_rpc_error(error, address) from error
        raise AssertionError("unreachable: the last route raises")

    def _stream(
        self,
        request: pb.GenerateRequest,
        timeout: float | None,
        trace: Pairs,
        session_id: str | None,
        stream: RoundStream,
    ) -> Generator[Round, None, None]:
        routes = self._routes(session_id)
        options = self._call_options(timeout, trace, session_id)
        for index, (address, stub) in enumerate(routes):
            call = stub.Generate(request, **options)
            stream.calling(call)
            received = False
            try:
                for response in call:
                    received = True
                    yield Round.from_proto(response)
                return
            except grpc.RpcError as error:
                if received or index + 1 == len(routes) or not is_down(error):
                    raise from_rpc_error(error, address) from error
            finally:
                call.cancel()  # a no-op once the stream has ended

    def _routes(self, session_id: str | None) -> Routes:
        """Where a call goes: the balanced channel, or the session's addresses best first."""
        if session_id is None or not self._spec.routed:
            return [(self.address, self._stub)]
        targets = dict(self._spec.endpoints)
        return [
            (address, self._alone_stub(address, targets[address]))
            for address in rendezvous_order(session_id, list(targets))
        ]

    def _alone_stub(self, address: str, target: str) -> pb_grpc.GeneratorStub:
        if address not in self._alone:
            channel = _open_channel(self._spec, target, self._spec.options_alone())
            self._alone[address] = (channel, pb_grpc.GeneratorStub(channel))
        return self._alone[address][1]

    def _call_options(
        self, timeout: float | None, trace: Pairs, session_id: str | None
    ) -> dict[str, Any]:
        # wait_for_ready=False: fail fast with UNAVAILABLE rather than wait for a server.
        return {
            "timeout": timeout if timeout is not None else self._timeout,
            "metadata": self._spec.metadata + session_metadata(session_id) + trace,
            "wait_for_ready": False,
        }


def _open_channel(
    spec: ChannelSpec, target: str, options: tuple[tuple[str, str | int], ...]
) -> grpc.Channel:
    if spec.credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, spec.credentials, options=options)

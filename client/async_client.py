"""`AsyncClient`: the kenspec API over a grpc.aio channel."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Unpack

import grpc
import grpc.aio
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


class AsyncClient:
    """Asyncio client; use as ``async with AsyncClient("host:port") as client: ...``.

    `address` is one gRPC target or several host:port entries (a list or a comma-separated
    string) balanced round-robin. TLS is on when `tls` or any `tls_*` is set (`tls_ca` None =
    system roots; `tls_cert`+`tls_key` = mTLS). `token` is sent as ``authorization: Bearer``
    metadata; None reads ``KENSPEC_TOKEN`` now, "" sends none. `timeout` (seconds) is the
    default deadline of every call; a generate stream must finish within it.
    `session_id` goes with every call as ``x-session-id`` metadata (a balancer such as
    deploy/nginx.conf keeps a session on one replica); with several addresses, the client
    sends a session's calls to one of them itself (see client/session_affinity.py). ``generate`` and
    ``generate_text`` take a `session_id` of their own ("" for none) for one client serving
    many conversations. The channels open on first use, in the event loop that uses them.
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
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GeneratorStub | None = None
        # one channel per address, opened on a session's first call there
        self._alone: dict[str, tuple[grpc.aio.Channel, pb_grpc.GeneratorStub]] = {}

    @property
    def address(self) -> str:
        return self._spec.address

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
        for channel, _ in self._alone.values():
            await channel.close()
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
    ) -> AsyncIterator[Round]:
        """Stream the rounds of one generation as they arrive.

        Bad arguments raise ``ValueError`` here, before anything is sent; call failures raise
        a `KenspecError` from the iteration. Leaving the loop early cancels the call.
        The call carries the current OpenTelemetry span's context (when the application uses
        OpenTelemetry), or `traceparent` (a W3C traceparent) when given, and the session id:
        `session_id`, else the client's.
        """
        request = build_generate_request(prompt, messages, **options)
        session = call_session(self._session_id, session_id)
        return self._stream(request, timeout, trace_metadata(traceparent), session)

    async def generate_text(
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
        (completion,) = await self.generate_choices(
            prompt,
            messages,
            timeout=timeout,
            traceparent=traceparent,
            session_id=session_id,
            **options,
        )
        return completion

    async def generate_choices(
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
        rounds = [r async for r in stream]
        return completions_from_rounds(rounds, self.address)

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        return_tokens: bool = False,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        request = build_tokenize_request(prompt, messages, return_tokens=return_tokens)
        return await self._unary("Tokenize", request, timeout)

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return await self._unary("GetModelInfo", pb.GetModelInfoRequest(), timeout)

    async def _unary(self, method: str, request: Message, timeout: float | None) -> Any:
        routes = self._routes(self._session_id)
        options = self._call_options(timeout, trace_metadata(), self._session_id)
        for index, (address, stub) in enumerate(routes):
            try:
                return await getattr(stub, method)(request, **options)
            except grpc.RpcError as error:
                if index + 1 < len(routes) and is_down(error):
                    continue  # this session's address is down: its next one
                raise from_rpc_error(error, address) from error
        raise AssertionError("unreachable: the last route raises")

    async def _stream(
        self,
        request: pb.GenerateRequest,
        timeout: float | None,
        trace: Pairs,
        session_id: str | None,
    ) -> AsyncIterator[Round]:
        routes = self._routes(session_id)
        options = self._call_options(timeout, trace, session_id)
        for index, (address, stub) in enumerate(routes):
            call = stub.Generate(request, **options)
            received = False
            try:
                async for response in call:
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
            return [(self.address, self._connect())]
        targets = dict(self._spec.endpoints)
        return [
            (address, self._alone_stub(address, targets[address]))
            for address in rendezvous_order(session_id, list(targets))
        ]

    def _connect(self) -> pb_grpc.GeneratorStub:
        if self._stub is None:
            self._channel = self._open(self._spec.target, self._spec.options)
            self._stub = pb_grpc.GeneratorStub(self._channel)
        return self._stub

    def _alone_stub(self, address: str, target: str) -> pb_grpc.GeneratorStub:
        if address not in self._alone:
            channel = self._open(target, self._spec.options_alone())
            self._alone[address] = (channel, pb_grpc.GeneratorStub(channel))
        return self._alone[address][1]

    def _open(self, target: str, options: tuple[tuple[str, str | int], ...]) -> grpc.aio.Channel:
        if self._spec.credentials is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, self._spec.credentials, options=options)

    def _call_options(
        self, timeout: float | None, trace: Pairs, session_id: str | None
    ) -> dict[str, Any]:
        # wait_for_ready=False: fail fast with UNAVAILABLE instead of queueing until a
        # server appears, so a wrong address is reported at once.
        return {
            "timeout": timeout if timeout is not None else self._timeout,
            "metadata": self._spec.metadata + session_metadata(session_id) + trace,
            "wait_for_ready": False,
        }

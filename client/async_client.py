"""`AsyncClient`: the kenspec API over a grpc.aio channel."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Unpack

import grpc
import grpc.aio

from kenspec_api import generator_pb2 as pb
from kenspec_api import generator_pb2_grpc as pb_grpc

from .channel import DEFAULT_ADDRESS, ChannelSpec, Pairs, channel_spec, tls_config
from .errors import from_rpc_error
from .request import ChatTurn, GenerateOptions, build_generate_request, build_tokenize_request
from .results import Completion, Round, completion_from_rounds
from .tracing import trace_metadata


class AsyncClient:
    """Asyncio client; use as ``async with AsyncClient("host:port") as client: ...``.

    `address` is one gRPC target or several host:port entries (a list or a comma-separated
    string) balanced round-robin. TLS is on when `tls` or any `tls_*` is set (`tls_ca` None =
    system roots; `tls_cert`+`tls_key` = mTLS). `token` is sent as ``authorization: Bearer``
    metadata; None reads ``KENSPEC_TOKEN`` now, "" sends none. `timeout` (seconds) is the
    default deadline of every call; a generate stream must finish within it.
    The channel opens on first use, in the event loop that uses it.
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
    ) -> None:
        tls_settings = tls_config(tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._spec: ChannelSpec = channel_spec(address, tls_settings, token)
        self._timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GeneratorStub | None = None

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

    def generate(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncIterator[Round]:
        """Stream the rounds of one generation as they arrive.

        Bad arguments raise ``ValueError`` here, before anything is sent; call failures raise
        a `KenspecError` from the iteration. Leaving the loop early cancels the call.
        The call carries the current OpenTelemetry span's context (when the application uses
        OpenTelemetry), or `traceparent` (a W3C traceparent) when given.
        """
        request = build_generate_request(prompt, messages, **options)
        return self._stream(request, timeout, trace_metadata(traceparent))

    async def generate_text(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion:
        """Run one generation to the end and join its rounds."""
        stream = self.generate(
            prompt, messages, timeout=timeout, traceparent=traceparent, **options
        )
        rounds = [r async for r in stream]
        return completion_from_rounds(rounds, self.address)

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        return_tokens: bool = False,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        request = build_tokenize_request(prompt, messages, return_tokens=return_tokens)
        try:
            options = self._call_options(timeout, trace_metadata())
            return await self._connect().Tokenize(request, **options)
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.address) from error

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        request = pb.GetModelInfoRequest()
        try:
            options = self._call_options(timeout, trace_metadata())
            return await self._connect().GetModelInfo(request, **options)
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.address) from error

    async def _stream(
        self, request: pb.GenerateRequest, timeout: float | None, trace: Pairs
    ) -> AsyncIterator[Round]:
        call = self._connect().Generate(request, **self._call_options(timeout, trace))
        try:
            async for response in call:
                yield Round.from_proto(response)
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.address) from error
        finally:
            call.cancel()  # a no-op once the stream has ended

    def _connect(self) -> pb_grpc.GeneratorStub:
        if self._stub is None:
            spec = self._spec
            if spec.credentials is None:
                self._channel = grpc.aio.insecure_channel(spec.target, options=spec.options)
            else:
                self._channel = grpc.aio.secure_channel(
                    spec.target, spec.credentials, options=spec.options
                )
            self._stub = pb_grpc.GeneratorStub(self._channel)
        return self._stub

    def _call_options(self, timeout: float | None, trace: Pairs) -> dict[str, Any]:
        # wait_for_ready=False: fail fast with UNAVAILABLE instead of queueing until a
        # server appears, so a wrong address is reported at once.
        return {
            "timeout": timeout if timeout is not None else self._timeout,
            "metadata": self._spec.metadata + trace,
            "wait_for_ready": False,
        }

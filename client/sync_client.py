"""`Client`: the kenspec API over a plain (blocking) grpc channel."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Unpack

import grpc

from kenspec_api import generator_pb2 as pb
from kenspec_api import generator_pb2_grpc as pb_grpc

from .channel import DEFAULT_ADDRESS, ChannelSpec, Pairs, channel_spec, tls_config
from .errors import from_rpc_error
from .request import ChatTurn, GenerateOptions, build_generate_request, build_tokenize_request
from .results import Completion, Round, completion_from_rounds
from .tracing import trace_metadata


class Client:
    """Blocking client; use as ``with Client("host:port") as client: ...``.

    Takes the same arguments as `AsyncClient` (see there): one target or several balanced
    round-robin, optional TLS/mTLS, a bearer token (default ``KENSPEC_TOKEN``), a default
    per-call timeout in seconds.
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
        self._channel = _open_channel(self._spec)
        self._stub = pb_grpc.GeneratorStub(self._channel)

    @property
    def address(self) -> str:
        return self._spec.address

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[Round]:
        """Stream the rounds of one generation as they arrive (see `AsyncClient.generate`,
        and there for the trace context sent)."""
        request = build_generate_request(prompt, messages, **options)
        return self._stream(request, timeout, trace_metadata(traceparent))

    def generate_text(
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
        rounds = list(stream)
        return completion_from_rounds(rounds, self.address)

    def tokenize(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatTurn] | None = None,
        *,
        return_tokens: bool = False,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        request = build_tokenize_request(prompt, messages, return_tokens=return_tokens)
        try:
            return self._stub.Tokenize(request, **self._call_options(timeout, trace_metadata()))
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.address) from error

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        request = pb.GetModelInfoRequest()
        try:
            options = self._call_options(timeout, trace_metadata())
            return self._stub.GetModelInfo(request, **options)
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.address) from error

    def _stream(
        self, request: pb.GenerateRequest, timeout: float | None, trace: Pairs
    ) -> Iterator[Round]:
        call = self._stub.Generate(request, **self._call_options(timeout, trace))
        try:
            for response in call:
                yield Round.from_proto(response)
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.address) from error
        finally:
            call.cancel()  # a no-op once the stream has ended

    def _call_options(self, timeout: float | None, trace: Pairs) -> dict[str, Any]:
        # wait_for_ready=False: fail fast with UNAVAILABLE rather than wait for a server.
        return {
            "timeout": timeout if timeout is not None else self._timeout,
            "metadata": self._spec.metadata + trace,
            "wait_for_ready": False,
        }


def _open_channel(spec: ChannelSpec) -> grpc.Channel:
    if spec.credentials is None:
        return grpc.insecure_channel(spec.target, options=spec.options)
    return grpc.secure_channel(spec.target, spec.credentials, options=spec.options)

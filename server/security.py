"""TLS credentials and bearer-token authentication for the gRPC server."""

from __future__ import annotations

import functools
import hashlib
import hmac
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc

from kenspec.server.engine.tenant_index import SHARED_TENANT

HEALTH_PREFIX = "/grpc.health.v1.Health/"  # probes (load balancers, kubelets) carry no token


def tls_context(cert: str, key: str, client_ca: str = "", *, alpn: str) -> ssl.SSLContext:
    """A server's TLS: the certificate chain and key; with client_ca, clients must present a
    certificate signed by it (mutual TLS; no system CA is trusted). `alpn`: the protocol
    offered ("h2" for gRPC, which its clients require; "http/1.1"). TLS 1.2 at least, as
    Python's default context has it (and HTTP/2 requires)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols([alpn])
    return context


def listening_socket(host: str, port: int, api: str) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port), not yet listening; OSError naming
    the address and `api` when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({api}): {error}") from None
    return sock


def read_tokens(path: str) -> tuple[bytes, ...]:
    """One token per line; blank lines and # comments ignored. An empty file is an error."""
    tokens = tuple(
        line.strip().encode()
        for line in Path(path).read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    if not tokens:
        raise ValueError(f"{path} holds no tokens; authentication would refuse every call")
    return tokens


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health checks needs `authorization: Bearer <token>` with an allowed token.

    Tokens are compared with hmac.compare_digest against every allowed one, so the time taken
    does not reveal how much of a guess was right. `on_refused` hears the method of each call
    refused (so the metrics count calls that never reach their handler).
    """

    def __init__(
        self, tokens: tuple[bytes, ...], on_refused: Callable[[str], None] | None = None
    ) -> None:
        self._tokens = tokens
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        presented = _bearer(handler_call_details.invocation_metadata or ())
        if presented is not None and self._allowed(presented):
            return handler
        if self._on_refused is not None:
            self._on_refused(handler_call_details.method)
        if presented is None:
            return _refusal(handler, "missing bearer token: send 'authorization: Bearer <token>'")
        return _refusal(handler, "invalid bearer token")

    def _allowed(self, presented: bytes) -> bool:
        return token_allowed(presented, self._tokens)


def bearer_token(authorization: str) -> bytes:
    """The token of an `authorization` value `Bearer <token>`; b"" for another scheme or none."""
    scheme, _, token = authorization.partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


def tenant_of(authorization: str, tokens: tuple[bytes, ...]) -> str:
    """Whose answers a call drafts from and learns into (the suffix index, the prefix cache):
    with tokens, a keyed hash of the caller's bearer token (HMAC-SHA256 under tenant_key,
    16 hex digits), so the token itself is never stored, logged or published; without tokens,
    every caller is SHARED_TENANT (a bearer value the server does not check cannot make
    tenants)."""
    if not tokens:
        return SHARED_TENANT
    token = bearer_token(authorization)
    return "t" + hmac.new(tenant_key(tokens), token, hashlib.sha256).hexdigest()[:16]


@functools.lru_cache(maxsize=4)
def tenant_key(tokens: tuple[bytes, ...]) -> bytes:
    """The key of tenant ids: a hash of the allowed tokens themselves (sorted, each with its
    length), so every replica serving the same tokens file names a caller alike (the shared
    answer stream carries tenant ids from one replica to another) while only those who hold
    every token could compute an id from a token. Changing the file changes every id."""
    digest = hashlib.sha256(b"kenspec tenant key v1\0")
    for token in sorted(tokens):
        digest.update(len(token).to_bytes(4, "big") + token)
    return digest.digest()


def token_allowed(presented: bytes, tokens: tuple[bytes, ...]) -> bool:
    """Whether `presented` is one of `tokens`, compared with every one in constant time.

    compare_digest returns at once when its arguments differ in length, which would tell a
    guess of the right length from one of another: it compares SHA-256 digests instead, of
    equal length whatever was presented."""
    digest = hashlib.sha256(presented).digest()
    matches = [hmac.compare_digest(digest, hashlib.sha256(token).digest()) for token in tokens]
    return any(matches)


def _bearer(metadata) -> bytes | None:  # type: ignore[no-untyped-def]
    for key, value in metadata:
        if key == "authorization":
            return bearer_token(value.decode() if isinstance(value, bytes) else value)
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def unary(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **serializers)
    return grpc.stream_stream_rpc_method_handler(stream, **serializers)

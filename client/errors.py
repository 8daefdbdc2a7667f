"""Exceptions the kenspec client raises, translated from gRPC status codes.

Every failure of a call surfaces as a `KenspecError` carrying the gRPC status code and the
server's own message (which the server writes for a user to act on), never a raw
`grpc.RpcError`. Subclasses let callers catch the cases they can handle.
"""

from __future__ import annotations

import grpc


class KenspecError(Exception):
    """A kenspec call failed; `code` is the gRPC status (None for client-side failures)."""

    def __init__(self, code: grpc.StatusCode | None, message: str, address: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.address = address

    @property
    def code_name(self) -> str:
        """The status code's name, e.g. ``"INVALID_ARGUMENT"``; ``"UNKNOWN"`` when there is none."""
        return self.code.name if self.code is not None else "UNKNOWN"

    def __str__(self) -> str:
        return f"{self.code_name}: {self.message}"


class ServerUnavailable(KenspecError):
    """No server answered at `address` (down, wrong address, TLS mismatch, or overloaded)."""


class InvalidRequest(KenspecError):
    """The server rejected the request's parameters (INVALID_ARGUMENT, OUT_OF_RANGE)."""


class AuthenticationError(KenspecError):
    """Missing or wrong bearer token (UNAUTHENTICATED, PERMISSION_DENIED)."""


class DeadlineExceeded(KenspecError):
    """The call ran past its timeout."""


class ServerBusy(KenspecError):
    """The server is at capacity (RESOURCE_EXHAUSTED); retry after `retry_after_s` (the
    server's gRPC pushback trailer; None when it sent none, e.g. out of memory)."""

    retry_after_s: float | None = None


class ProtocolError(KenspecError):
    """The server's stream broke the API contract (e.g. ended without a finish reason)."""


_BY_CODE: dict[grpc.StatusCode, type[KenspecError]] = {
    grpc.StatusCode.UNAVAILABLE: ServerUnavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServerBusy,
}


def from_rpc_error(error: grpc.RpcError, address: str) -> KenspecError:
    """Translate a failed call (sync or aio) into the matching `KenspecError` subclass."""
    # grpc.RpcError declares no accessors; both the sync and the aio errors implement them.
    code: grpc.StatusCode = getattr(error, "code", lambda: grpc.StatusCode.UNKNOWN)()
    details: str = getattr(error, "details", lambda: "")() or ""
    kind = _BY_CODE.get(code, KenspecError)
    if kind is ServerUnavailable:
        details = f"cannot reach the kenspec server at {address}: {details or 'no details'}"
    result = kind(code, details or "no details from the server", address)
    if isinstance(result, ServerBusy):
        result.retry_after_s = _pushback_s(error)
    return result


def _pushback_s(error: grpc.RpcError) -> float | None:
    """The server's `grpc-retry-pushback-ms` trailer, in seconds (gRFC A6), if it sent one."""
    trailers = getattr(error, "trailing_metadata", lambda: None)() or ()
    for key, value in trailers:
        if key == "grpc-retry-pushback-ms":
            try:
                return max(0.0, int(value) / 1000.0)
            except ValueError:
                return None
    return None

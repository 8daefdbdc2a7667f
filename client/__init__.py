"""kenspec client: talk to a kenspec server over gRPC without torch.

    from kenspec.client import Client
    with Client("127.0.0.1:50051") as kenspec:
        print(kenspec.generate_text("Once upon a time", max_new_tokens=32).text)

Needs only grpcio and protobuf. The generated API modules are in `kenspec.api`.
"""

from __future__ import annotations

from .async_client import AsyncClient
from .errors import (
    AuthenticationError,
    DeadlineExceeded,
    InvalidRequest,
    KenspecError,
    ProtocolError,
    ServerBusy,
    ServerUnavailable,
)
from .results import Alternative, Completion, Logprob, Round, ToolCall, Usage
from .sync_client import Client, RoundStream

__all__ = [
    "Alternative",
    "AsyncClient",
    "AuthenticationError",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "InvalidRequest",
    "KenspecError",
    "Logprob",
    "ProtocolError",
    "Round",
    "RoundStream",
    "ServerBusy",
    "ServerUnavailable",
    "ToolCall",
    "Usage",
]

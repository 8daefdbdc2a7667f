"""Session affinity: the calls of one conversation go to one server, which holds its prefix.

A session id travels as ``x-session-id`` metadata on every call of the session, so a balancer
in front of the replicas (deploy/nginx.conf hashes it) sends them all to one replica, whose
prefix cache then holds the conversation's history.

When the client itself balances over several addresses, a call with a session id goes to the
address with the highest rendezvous (highest-random-weight) score for that session,
``blake2b(session id, address)``: every client process picks the same address for a session
without sharing any state, and removing an address moves only the sessions that were on it.
If that address is down (the call fails with UNAVAILABLE before anything arrived), the call
goes to the next address by score, and so on. Nothing is remembered between calls: the next
call of the session tries its first address again, so the session returns once it is back.
Calls without a session id are balanced round-robin over all the addresses, as before.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Sequence

import grpc

SESSION_KEY = "x-session-id"  # nginx sees it as $http_x_session_id, on HTTP and on gRPC
MAX_SESSION_ID_CHARS = 128
_SESSION_ID = re.compile(rf"[!-~]{{1,{MAX_SESSION_ID_CHARS}}}")  # visible ASCII, no spaces


def new_session_id() -> str:
    """A fresh random session id (what `kenspec chat` uses for each chat)."""
    return uuid.uuid4().hex


def check_session_id(session_id: str | None) -> str | None:
    """`session_id` if it can travel as metadata and a header; None for None or "".

    >>> check_session_id("user-42/chat-7")
    'user-42/chat-7'
    """
    if not session_id:
        return None
    if not _SESSION_ID.fullmatch(session_id):
        raise ValueError(
            f"session_id must be 1-{MAX_SESSION_ID_CHARS} visible ASCII characters without "
            f"spaces (e.g. a UUID), not {session_id!r}"
        )
    return session_id


def call_session(client_session: str | None, given: str | None) -> str | None:
    """A call's session: its own when given ("" for none, checked), else the client's."""
    return client_session if given is None else check_session_id(given)


def session_metadata(session_id: str | None) -> tuple[tuple[str, str], ...]:
    return ((SESSION_KEY, session_id),) if session_id else ()


def rendezvous_order(session_id: str, addresses: Sequence[str]) -> list[str]:
    """`addresses` best first for `session_id`: the first is its home, the rest the fallbacks.

    >>> rendezvous_order("chat-1", ["a:1", "b:1", "c:1"])
    ['c:1', 'b:1', 'a:1']
    """
    return sorted(addresses, key=lambda address: (-_score(session_id, address), address))


def _score(session_id: str, address: str) -> int:
    # A stable hash (Python's hash() changes per process); the NUL keeps ("ab", "c") and
    # ("a", "bc") apart.
    digest = hashlib.blake2b(f"{session_id}\0{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def is_down(error: grpc.RpcError) -> bool:
    """Whether a call that failed before any response may go to the next address: the server
    did not take it (unreachable, refusing, draining)."""
    return error.code() == grpc.StatusCode.UNAVAILABLE

"""What the HTTP API checks before it reads a body: who may call (Host and Origin without
tokens), what the body must be (JSON), and the refusal every check raises (HttpError).

Without bearer tokens a server on loopback is still reachable from any web page open in its
user's browser: a page can POST to ``http://127.0.0.1:8000`` (CSRF), or a name it controls
can be made to resolve to 127.0.0.1 (DNS rebinding) and then read the answers. Both carry the
page's names, in ``Origin`` and in ``Host``, so a request whose Host or Origin is not an
allowed name is refused: Host with 421 (this server does not answer for that name), Origin
with 403. Browsers send either header whatever the page wants, and a bearer token is the
stronger check: with tokens no name is checked. Refusing every body that is not
``application/json`` also keeps out the "simple" form and text posts a page may send
without asking the browser first.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.responses import JSONResponse

from kenspec.server.openai_api.responses import error_body

_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})  # every interface: no one name
_PORT = re.compile(r"(?::[0-9]{1,5})?")
_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#@]*)")


class HttpError(Exception):
    """A refusal before any generation: its status and OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str = "",
        *,
        close: bool = False,  # the connection cannot be reused (a body left unread)
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.close = status, param, code or None, close
        self.headers = headers or {}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = error_body(self.status, str(self), self.param, self.code)
        headers = {**self.headers, **(headers or {})}
        if self.close:
            headers["connection"] = "close"
        return JSONResponse(body, self.status, headers=headers)


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """The names a server without tokens answers to: loopback (``localhost``, 127.0.0.0/8,
    ``::1``) always, plus `names` (``--allowed-hosts`` and a concrete ``--host``)."""

    names: frozenset[str]
    any_host: bool = False

    @classmethod
    def of(cls, allowed_hosts: str, bind_host: str) -> HostPolicy:
        """From ``--allowed-hosts`` (comma-separated names, ``*`` for any) and ``--host``."""
        names = {_normal(name) for name in allowed_hosts.split(",") if name.strip()}
        if bind_host.strip() not in _WILDCARD_BINDS:
            names.add(_normal(bind_host))
        return cls(frozenset(names - {"*"}), "*" in names)

    def allows(self, name: str | None) -> bool:
        if name is None:
            return False
        if self.any_host or name == "localhost" or name in self.names:
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    def check(self, headers: Mapping[str, str]) -> None:
        """HttpError 421 for a Host not allowed, 403 for an Origin not allowed."""
        host = headers.get("host")
        if not self.allows(_host_name(host or "")):
            raise HttpError(
                421,
                f"this server does not answer for the host {_shown(host)}: call it by a "
                "loopback address or a name of --allowed-hosts (or give it --auth-tokens-file)",
                param="host",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self.allows(_origin_host(origin)):
            raise HttpError(
                403,
                f"requests from the origin {_shown(origin)} are refused: the server has no "
                "tokens, so only pages served from a loopback or --allowed-hosts name may call",
                param="origin",
                code="origin_not_allowed",
            )


def check_json_content_type(headers: Mapping[str, str]) -> None:
    """415 unless the body is declared ``application/json`` (parameters allowed; a charset,
    if given, UTF-8)."""
    declared = headers.get("content-type", "")
    media, *parameters = declared.split(";")
    charset = next(
        (value for key, _, value in (p.partition("=") for p in parameters) if _is(key, "charset")),
        "utf-8",
    )
    if _is(media, "application/json") and charset.strip().strip('"').lower() in ("utf-8", "utf8"):
        return
    raise HttpError(
        415,
        f"the body must be JSON in UTF-8, sent with 'Content-Type: application/json' "
        f"(got {_shown(declared) if declared else 'no Content-Type'})",
        param="content-type",
        code="unsupported_media_type",
    )


def _is(text: str, expected: str) -> bool:
    return text.strip().lower() == expected


def _host_name(authority: str) -> str | None:
    """The host of a Host header or an origin's authority (``name[:port]``, ``[v6][:port]``),
    lowercased, without a trailing dot; None when it is not one."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        name, bracket, port = authority[1:].partition("]")
        if not bracket:
            return None
    else:
        name, colon, port = authority.partition(":")
        port = colon + port
    if not _PORT.fullmatch(port):
        return None
    return name.rstrip(".") or None


def _origin_host(origin: str) -> str | None:
    match = _ORIGIN.fullmatch(origin.strip())  # "null" (sandboxed pages, files) matches nothing
    return _host_name(match.group(1)) if match else None


def _normal(name: str) -> str:
    """An --allowed-hosts entry as _host_name returns names: no brackets, case or final dot."""
    return name.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")


def _shown(value: str | None, limit: int = 64) -> str:
    if value is None:
        return "(none)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

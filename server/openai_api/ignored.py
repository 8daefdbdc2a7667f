"""Fields a request sent that kenspec accepts without acting on them, as vLLM does: OpenAI's
fields that ask nothing of the output (``metadata``, ``store``, ``service_tier``, a content
part's ``cache_control``, ...) and fields outside OpenAI's API altogether (``foo``). Each
answer lists them in the ``x-kenspec-ignored-fields`` header, and the request logs them once
(info; warning when one is outside OpenAI's API), so a client that meant one to act learns
that it did not. Fields whose meaning kenspec cannot honour are refused instead
(openai_request.py), never listed here.

A body can hold any number of keys of any length and characters, and a header must stay short
and printable: at most MAX_LISTED names are listed, each percent-encoded (only letters, digits
and ``_ . - [ ]`` stay as they are: no comma, space or line break a client could split on) and
cut to 64 characters as error messages cut keys, then ``+N more``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import quote

import structlog

from kenspec.server.openai_api.fields import key

log = structlog.get_logger("kenspec.http")

IGNORED_HEADER = "x-kenspec-ignored-fields"
MAX_LISTED = 16  # names in the header and the log line
_MAX_KEPT = 1024  # distinct names remembered (for the count past MAX_LISTED)

# OpenAI's request fields that ask nothing of the output kenspec serves: accepted, not acted on.
IGNORED_FIELDS = frozenset(
    {
        "metadata",  # stored completions' tags
        "store",  # OpenAI keeps the completion
        "service_tier",  # OpenAI's processing tier
        "reasoning_effort",  # reasoning models' effort
        "verbosity",  # newer models' answer length hint
        "prediction",  # predicted output, a latency hint
        "prompt_cache_key",  # OpenAI's cache routing
        "safety_identifier",  # OpenAI's abuse tracking
    }
)


@dataclass(slots=True)
class Ignored:
    """The ignored fields of one request, in the order met, each once; `unknown` the ones
    outside OpenAI's API (what makes its log line a warning)."""

    names: list[str] = field(default_factory=list)
    unknown: bool = False
    more: int = 0  # further fields past _MAX_KEPT distinct ones (not deduplicated)
    _seen: set[str] = field(default_factory=set)

    def add(self, name: str, *, unknown: bool = False) -> None:
        """`name`: a top-level key, or a path such as ``messages[].name``, each key in it
        already cut with fields.key (a client's key may be a megabyte long)."""
        self.unknown |= unknown
        if name in self._seen:
            return
        if len(self.names) >= _MAX_KEPT:
            self.more += 1
            return
        self._seen.add(name)
        self.names.append(name)

    @property
    def count(self) -> int:
        return len(self.names) + self.more

    def header(self) -> dict[str, str]:
        """The response header listing them; none when nothing was ignored."""
        if not self.count:
            return {}
        listed = [key(quote(name, safe="[]._-")) for name in self.names[:MAX_LISTED]]
        if self.count > MAX_LISTED:
            listed.append(f"+{self.count - MAX_LISTED} more")
        return {IGNORED_HEADER: ",".join(listed)}

    def log(self, request_id: str, route: str) -> None:
        """One line per request that sent any: info, or warning with a field outside the API."""
        if not self.count:
            return
        report = log.warning if self.unknown else log.info
        report(
            "ignored_fields",
            request_id=request_id,
            route=route,
            fields=self.names[:MAX_LISTED],
            count=self.count,
            unknown=self.unknown,
        )

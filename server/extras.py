"""The server's optional parts, each installed by an extra of the kenspec distribution.

- ``redis`` (redis): --share-answers, the shared answer stream (server.answer_stream);
- ``grammar`` (llguidance): structured output, grammars and tool calls (server.engine.grammar);
- ``otel`` (the OpenTelemetry SDK and OTLP exporter): --otel (server.otel, server.tracing).

``pip install 'kenspec[all]'`` installs them all. Without one, the server starts and serves
every request that does not need it: its module imports the package only when the part is used.
A flag that needs a missing part stops the server at start-up (`check_extras`: ExtraMissing, a
ValueError, the start-up error path); a request that needs one is refused as UNIMPLEMENTED
(HTTP 501): the server's configuration, not the caller's request, is what falls short. Both
messages name the ``pip install`` that adds the part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from kenspec.server.engine.extras import GRAMMAR_FEATURE, install_command, missing_package, require

if TYPE_CHECKING:
    from kenspec.server.settings import Settings

log = structlog.get_logger("kenspec.server")


def check_extras(settings: Settings) -> None:
    """At start-up: refuse a flag whose optional part is not installed (ExtraMissing, a
    ValueError, naming the extra to install); log a warning for a missing part that requests
    need (the server goes on without it, refusing those requests)."""
    if settings.speculation.share_answers:
        require("redis", "--share-answers", "start without --share-answers")
    if settings.server.otel:
        require("otel", "--otel", "start without --otel")
    missing = missing_package("grammar")
    if missing is not None:
        log.warning(
            "optional_part_missing",
            extra="grammar",
            missing=missing,
            refused=GRAMMAR_FEATURE,
            install=install_command("grammar"),
        )

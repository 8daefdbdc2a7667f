"""structlog set-up: JSON lines for machines, console for humans; request ids from contextvars."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(log_format: str = "auto", level: str = "info") -> None:
    """auto picks console on a terminal and JSON otherwise (containers, log shippers)."""
    if log_format not in ("auto", "console", "json"):
        raise ValueError(f"log format {log_format!r} is not one of auto, console, json")
    numeric_level = logging.getLevelNamesMapping().get(level.upper())
    if numeric_level is None:
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error")
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    renderer = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,  # request_id bound by the servicer
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _route_standard_logging(renderer, numeric_level)


def _route_standard_logging(renderer: structlog.typing.Processor, level: int) -> None:
    """Libraries that log through `logging` (uvicorn, under the HTTP API) write the same lines
    as kenspec's own: JSON or console, with a level and a timestamp; warnings and above. A
    record's exc_info (uvicorn's "Exception in ASGI application") becomes the same `exception`
    text as kenspec's own events carry: left as a tuple, JSON would print its repr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(level, logging.WARNING))
    core = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, CallGoneInCore) for f in core.filters):
        core.addFilter(CallGoneInCore())
    uvicorn = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, BadHttpRequest) for f in uvicorn.filters):
        uvicorn.addFilter(BadHttpRequest())


class CallGoneInCore(logging.Filter):
    """grpc's asyncio server logs an error, with a traceback, when gRPC core refuses an
    operation on a call (ExecuteBatchError): a stream's message or final status sent just as
    its client cancelled or its deadline passed, which core has already ended. The call is
    gone and nothing is lost; this is logged as `grpc_call_gone` (info) instead."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        structlog.get_logger("kenspec.service").info(
            "grpc_call_gone", method=message.removeprefix(self.PREFIX).strip(" []")
        )
        return False


class BadHttpRequest(logging.Filter):
    """uvicorn warns of every request h11 cannot parse, and answers it 400 itself: the
    client's fault, not the server's, and any client could fill the log with them. Logged as
    `http_bad_request` (info) instead, as kenspec logs other refused input."""

    MESSAGE = "Invalid HTTP request received."

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != self.MESSAGE:
            return True
        structlog.get_logger("kenspec.http").info("http_bad_request", status=400)
        return False

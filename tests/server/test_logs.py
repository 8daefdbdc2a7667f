"""server.logs: library log lines in kenspec's format, and gRPC core's report of a call its
client had already ended logged as what it is."""

from __future__ import annotations

import json
import logging

import structlog

from kenspec.server.logs import BadHttpRequest, CallGoneInCore, configure_logging


def test_a_call_gone_in_core_is_info_and_other_grpc_errors_stay_errors(capsys) -> None:
    root = logging.getLogger()
    core = logging.getLogger("grpc._cython.cygrpc")
    saved = (root.handlers[:], root.level, core.filters[:], structlog.get_config())
    try:
        configure_logging("json", "info")
        configure_logging("json", "info")  # configured twice (tests, restarts): one filter
        assert sum(isinstance(f, CallGoneInCore) for f in core.filters) == 1
        core.error(
            "ExecuteBatchError raised in core by servicer method [/kenspec.v1.Generator/Generate]"
        )
        core.error(
            "Unexpected [RuntimeError] raised by servicer method [/kenspec.v1.Generator/Generate]"
        )
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    finally:
        root.handlers, core.filters = saved[0], saved[2]
        root.setLevel(saved[1])
        structlog.configure(**saved[3])
    gone = [line for line in lines if line.get("event") == "grpc_call_gone"]
    assert gone == [{**gone[0], "level": "info", "method": "/kenspec.v1.Generator/Generate"}]
    errors = [line for line in lines if line.get("level") == "error"]
    assert len(errors) == 1 and "Unexpected [RuntimeError]" in errors[0]["event"]


def _log_with_traceback(capsys, log_format: str) -> str:
    """What configure_logging(log_format) writes for a stdlib record with exc_info, as uvicorn
    logs "Exception in ASGI application"."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, structlog.get_config())
    try:
        configure_logging(log_format, "info")
        try:
            raise ValueError("the handler failed")
        except ValueError as error:
            uvicorn = logging.getLogger("uvicorn.error")
            uvicorn.error("Exception in ASGI application", exc_info=error)
        return capsys.readouterr().err
    finally:
        root.handlers = saved[0]
        root.setLevel(saved[1])
        structlog.configure(**saved[2])


def test_library_records_keep_their_traceback_in_json(capsys) -> None:
    (line,) = [json.loads(line) for line in _log_with_traceback(capsys, "json").splitlines()]
    assert line["event"] == "Exception in ASGI application"
    assert line["level"] == "error" and line["logger"] == "uvicorn.error"
    assert "exc_info" not in line  # not a repr of (type, value, <traceback object at 0x…>)
    assert line["exception"].startswith("Traceback (most recent call last):")
    assert 'raise ValueError("the handler failed")' in line["exception"]
    assert line["exception"].rstrip().endswith("ValueError: the handler failed")


def test_library_records_keep_their_traceback_on_the_console(capsys) -> None:
    text = _log_with_traceback(capsys, "console")
    assert "Exception in ASGI application" in text
    assert "traceback object at" not in text
    assert "Traceback (most recent call last):" in text
    assert "ValueError: the handler failed" in text


def test_a_request_uvicorn_cannot_parse_is_info_and_its_other_warnings_stay(capsys) -> None:
    root = logging.getLogger()
    uvicorn = logging.getLogger("uvicorn.error")
    saved = (root.handlers[:], root.level, uvicorn.filters[:], structlog.get_config())
    try:
        configure_logging("json", "info")
        configure_logging("json", "info")
        assert sum(isinstance(f, BadHttpRequest) for f in uvicorn.filters) == 1
        uvicorn.warning("Invalid HTTP request received.")
        uvicorn.warning("Something else went wrong.")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    finally:
        root.handlers, uvicorn.filters = saved[0], saved[2]
        root.setLevel(saved[1])
        structlog.configure(**saved[3])
    assert [line["level"] for line in lines if line["event"] == "http_bad_request"] == ["info"]
    warnings = [line for line in lines if line.get("level") == "warning"]
    assert len(warnings) == 1 and warnings[0]["event"] == "Something else went wrong."

"""server.logs: library log lines in kenspec's format, and gRPC core's report of a call its
client had already ended logged as what it is."""

from __future__ import annotations

import json
import logging

import structlog

from server.logs import CallGoneInCore, configure_logging


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

"""The server-process harness says why a server that never started exited."""

from __future__ import annotations

import pytest

from harness.server_process import ServerProcess


def test_a_server_that_exits_before_logging_reports_its_last_lines() -> None:
    with pytest.raises(RuntimeError, match="unrecognized arguments: --no-such-flag"):
        ServerProcess(["--no-such-flag"], timeout=120)

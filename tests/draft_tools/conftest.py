"""draft_tools' entry points configure logging for their process (warnings only); run
in-process by these tests, that would hide the info lines later tests read. After each
module, the configuration the session started with comes back."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

_CONFIG = structlog.get_config()  # before any module of this folder ran a build (some do so
_ROOT = logging.getLogger()  # in module-scoped fixtures)
_HANDLERS, _LEVEL = list(_ROOT.handlers), _ROOT.level


@pytest.fixture(autouse=True, scope="module")
def _restore_logging() -> Iterator[None]:
    yield
    structlog.configure(**_CONFIG)
    _ROOT.handlers[:] = _HANDLERS
    _ROOT.setLevel(_LEVEL)

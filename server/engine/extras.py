"""The optional parts' packages: which extra installs each, how to check for one without
importing it, and the error a missing one is (ExtraMissing). kenspec.server.extras checks the
flags at start-up; the engine's grammar checks its own part per request.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

# extra -> the modules the server imports from it (the first missing one is named)
EXTRAS: dict[str, tuple[str, ...]] = {
    "redis": ("redis", "redis.asyncio"),
    "grammar": ("llguidance", "llguidance.hf", "llguidance.torch"),
    "otel": ("opentelemetry.propagate", "opentelemetry.sdk.trace"),
}
# what the `grammar` extra serves, as its messages name it
GRAMMAR_FEATURE = "structured output (grammars, JSON schemas, tool calls)"


def install_command(extra: str) -> str:
    return f"pip install 'kenspec[{extra}]'"


class ExtraMissing(ValueError):
    """`feature` needs `extra`, whose package `missing` is not installed."""

    def __init__(self, feature: str, extra: str, missing: str, alternative: str = "") -> None:
        self.feature, self.extra, self.missing = feature, extra, missing
        message = (
            f"{feature} needs the {extra!r} extra, which is not installed on this server "
            f"({missing} is missing): {install_command(extra)}"
        )
        super().__init__(f"{message}, or {alternative}" if alternative else message)


def require(extra: str, feature: str, alternative: str = "") -> None:
    """Import `extra`'s modules; ExtraMissing(feature, ...) if one of its packages is not
    installed (an ImportError from elsewhere, a broken install, is raised as it is)."""
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError as error:
            name = error.name or module
            if not _within(name, EXTRAS[extra]):
                raise
            raise ExtraMissing(feature, extra, name, alternative) from None


def missing_package(extra: str) -> str | None:
    """The first of `extra`'s packages that is not installed, or None: looked up, not
    imported (cheap enough for a request; a broken install shows when it is imported)."""
    for root in dict.fromkeys(module.split(".")[0] for module in EXTRAS[extra]):
        try:
            found = importlib.util.find_spec(root) is not None
        except (ImportError, ValueError):  # (a module that is there without a spec)
            found = root in sys.modules and sys.modules[root] is not None
        if not found:
            return root
    return None


def _within(name: str, modules: tuple[str, ...]) -> bool:
    """Whether module `name` is one of `modules`' packages (or a module under one)."""
    roots = {module.split(".")[0] for module in modules}
    return name.split(".")[0] in roots

"""KenLM's lmplz and build_binary for a draft build: found where `train.kenlm_tool` looks
(--tools, $KENSPEC_TOOLS_DIR/kenlm/bin, <repo>/tools/kenlm/bin, PATH), else built once by
scripts/build_kenlm_tools.sh, after checking that this machine can compile them."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from kenspec.draft_tools.train import kenlm_tool
from kenspec.server.settings import REPO_ROOT

BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_kenlm_tools.sh"
BOOST_HEADER = "boost/program_options.hpp"  # KenLM needs program_options, system, thread
INSTALL_HINT = (
    "install them (Debian/Ubuntu: `sudo apt-get install cmake make g++ "
    "libboost-program-options-dev libboost-system-dev libboost-thread-dev libboost-test-dev "
    "zlib1g-dev libbz2-dev liblzma-dev`; macOS: `brew install cmake boost`), "
    "or pass --tools DIR with prebuilt lmplz and build_binary"
)


class ToolsError(Exception):
    """lmplz/build_binary are missing and cannot be built; the message says what to do."""


def find_tools(tools_dir: str | None) -> tuple[Path, Path] | None:
    """(lmplz, build_binary), or None when either is missing."""
    try:
        return kenlm_tool("lmplz", tools_dir), kenlm_tool("build_binary", tools_dir)
    except FileNotFoundError:
        return None


def missing_build_deps(
    which: Callable[[str], str | None] = shutil.which,
    include_dirs: Sequence[Path] | None = None,
) -> list[str]:
    """What building KenLM needs and this machine lacks: [] when it can build.

    >>> missing_build_deps(lambda name: None, include_dirs=[])
    ['cmake', 'make', 'a C++ compiler', 'Boost headers (boost/program_options.hpp)']
    """
    missing = [name for name in ("cmake", "make") if which(name) is None]
    if not any(which(compiler) for compiler in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler")
    dirs = boost_include_dirs() if include_dirs is None else include_dirs
    if not any((folder / BOOST_HEADER).is_file() for folder in dirs):
        missing.append(f"Boost headers ({BOOST_HEADER})")
    return missing


def boost_include_dirs() -> list[Path]:
    """Where CMake's FindBoost would look: the usual prefixes, $BOOST_ROOT, $CPATH."""
    dirs = [Path(p) for p in ("/usr/include", "/usr/local/include", "/opt/homebrew/include")]
    if os.environ.get("BOOST_ROOT"):
        dirs.append(Path(os.environ["BOOST_ROOT"]) / "include")
    for variable in ("BOOST_INCLUDEDIR", "CPATH", "CPLUS_INCLUDE_PATH"):
        dirs += [Path(p) for p in os.environ.get(variable, "").split(os.pathsep) if p]
    return dirs


def ensure_tools(
    tools_dir: str | None, build_log: Path, say: Callable[[str], None]
) -> tuple[Path, Path]:
    """(lmplz, build_binary): found, or built by the script into $KENSPEC_TOOLS_DIR or
    <repo>/tools (never with sudo apt-get: a missing package is reported, not installed)."""
    found = find_tools(tools_dir)
    if found:
        return found
    if tools_dir:
        raise ToolsError(
            f"no lmplz and build_binary in --tools {tools_dir}; "
            "drop --tools to have them built into tools/kenlm/bin"
        )
    if not BUILD_SCRIPT.is_file():
        raise ToolsError(f"KenLM's lmplz and build_binary are missing; {INSTALL_HINT}")
    missing = missing_build_deps()
    if missing:
        raise ToolsError(
            f"KenLM's lmplz and build_binary are missing and cannot be built here "
            f"(no {', '.join(missing)}): {INSTALL_HINT}"
        )
    say(f"not found: building them from the kenlm sdist (once, minutes; log: {build_log})")
    build_log.parent.mkdir(parents=True, exist_ok=True)
    with build_log.open("w", encoding="utf-8") as sink:
        result = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KENSPEC_SKIP_APT": "1"},
            check=False,
        )
    found = find_tools(None)
    if result.returncode or not found:
        raise ToolsError(
            f"building KenLM's tools failed: {_last_line(build_log)} (full log: {build_log})"
        )
    return found


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    errors = [line for line in lines if "ERROR" in line]
    return (errors or [line for line in lines if line] or ["no output"])[-1]

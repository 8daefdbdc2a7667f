"""kenspec's build step: the C kernels compiled into the wheel. The metadata is pyproject.toml's.

build_py, after copying the packages, builds kenspec/server/engine/forward/_prebuilt/<key>/
(libkenspec.so and build.json) from the copied csrc/ by the recipe the server compiles with at
start-up (forward/kernel_build.py, loaded by its path: no torch here). A compiler that lacks an
instruction set's flag builds the rest, and build.json says so; no compiler, or a failed build,
leaves no prebuilt library (the server then compiles at start-up) unless KENSPEC_PREBUILD=require.
KENSPEC_PREBUILD=0 skips it. Editable installs skip it: they run the sources in place.

With the library the wheel is tagged py3-none-<platform> (it holds x86-64 code, called through
ctypes: no Python ABI).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
RECIPE = HERE / "kenspec" / "server" / "engine" / "forward" / "kernel_build.py"
PACKAGE = Path("kenspec", "server", "engine")  # csrc/ and forward/ below it


def _mode() -> str:
    mode = os.environ.get("KENSPEC_PREBUILD", "auto")
    if mode not in ("auto", "require", "0"):
        raise SystemExit(f"KENSPEC_PREBUILD={mode!r}: auto (default), require or 0")
    return mode


def _prebuilds() -> bool:
    """The kernels are x86-64 code for Linux: elsewhere the wheel stays pure."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return _mode() != "0" and sys.platform == "linux" and x86


def _recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kenspec_kernel_build", RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode and _prebuilds():
            self._kernels(Path(self.build_lib))

    def _kernels(self, build_lib: Path) -> None:
        recipe = _recipe()
        target = build_lib / PACKAGE / "forward" / "_prebuilt"
        shutil.rmtree(target, ignore_errors=True)  # an earlier build's, of other sources
        compiler = recipe.find_compiler()
        if compiler is None:
            return self._skip("no C compiler on PATH ($CC, cc or gcc)")
        sources = build_lib / PACKAGE / "csrc"
        scratch = target / "building"
        try:
            record = recipe.build(scratch, compiler, sources)
        except (OSError, subprocess.CalledProcessError, recipe.BuildError) as error:
            shutil.rmtree(target, ignore_errors=True)
            return self._skip(f"build with {compiler} failed: {error}")
        scratch.rename(target / record.key)
        for isa, why in record.missing().items():
            self.announce(f"kenspec kernels: built without {isa}: {why}", logging.WARNING)
        if record.missing() and _mode() == "require":
            raise SystemExit(f"kenspec kernels: KENSPEC_PREBUILD=require: {record.missing()}")
        self.announce(
            f"kenspec kernels: {target / record.key} ({', '.join(sorted(record.isa))}; "
            f"{record.version})",
            logging.INFO,
        )

    def _skip(self, reason: str) -> None:
        if _mode() == "require":
            raise SystemExit(f"kenspec kernels: KENSPEC_PREBUILD=require: {reason}")
        self.announce(f"kenspec kernels: no prebuilt library ({reason})", logging.WARNING)


class Platform(Distribution):
    """A distribution with the library is platform-specific (installed to platlib, tagged
    with the platform), as one with extension modules is."""

    def has_ext_modules(self) -> bool:
        return _prebuilds()


class BdistWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        impl, abi, plat = super().get_tag()
        return (impl, abi, plat) if self.root_is_pure else ("py3", "none", plat)


setup(distclass=Platform, cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})

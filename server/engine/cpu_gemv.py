"""A bfloat16 product for a few rows at memory speed on CPUs with AVX512-BF16 (csrc/gemv.c).

torch's bfloat16 `F.linear` reads a one-row pass's weights at a third of the memory's speed on
the CPUs kenspec targets (docs/design.md, "The target's step"); this kernel streams them once,
32 weights an instruction. It is compiled with the machine's C compiler the first time it is
needed and kept under `~/.cache/kenspec/kernels/<hash>/` (a restart loads it in
milliseconds), and called through ctypes. `load()` is None where it cannot run: no
avx512_bf16, no compiler, or a build that fails (then the server uses torch's kernels).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("kenspec.kernels")

SOURCE = Path(__file__).with_name("csrc") / "gemv.c"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp")
CACHE = Path(os.environ.get("KENSPEC_KERNEL_CACHE", "~/.cache/kenspec/kernels")).expanduser()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class Gemv:
    """y = x @ w^T for contiguous bfloat16 x [rows, k] and w [out, k], y [rows, out]."""

    library: ctypes.CDLL
    path: Path

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
        self.library.kenspec_gemv_bf16(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, k, weight.shape[0]
        )
        return out


@cache
def load() -> Gemv | None:
    """The compiled kernel, built once per machine and source; None where it cannot run."""
    if "avx512_bf16" not in cpu_flags():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("gemv_unavailable", reason="no C compiler (cc or gcc) on PATH")
        return None
    try:
        path = _build(compiler)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        log.warning("gemv_unavailable", reason=str(error))
        return None
    function = library.kenspec_gemv_bf16
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    return Gemv(library, path)


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler and flags, built if not cached."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), compiler, version, *FLAGS]).encode()
    ).hexdigest()[:16]
    target = CACHE / key / "gemv.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / "gemv.so"
        subprocess.run(
            [compiler, *FLAGS, "-shared", "-fPIC", str(SOURCE), "-o", str(built)],
            capture_output=True,
            text=True,
            check=True,
        )
        built.replace(target)  # atomic: a concurrent start-up loads one or the other
    log.info("gemv_built", path=str(target))
    return target

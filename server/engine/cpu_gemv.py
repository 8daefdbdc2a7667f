"""Products for a few rows at memory speed on AVX-512 CPUs: bfloat16 weights on CPUs with
AVX512-BF16 (csrc/gemv.c), int8 weights on any with AVX-512 F/BW/VL/DQ (csrc/gemv_int8.c).

torch's bfloat16 `F.linear` reads a one-row pass's weights at a third of the memory's speed on
the CPUs kenspec targets (docs/design.md, "The target's step"); these kernels stream them once.
Each is compiled with the machine's C compiler the first time it is needed and kept under
`~/.cache/kenspec/kernels/<hash>/` (a restart loads it in milliseconds), and called through
ctypes. `load()` and `load_int8()` are None where they cannot run: the CPU lacks the
instructions, no compiler, or a build that fails (then the server uses torch's kernels).
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
INT8_SOURCE = Path(__file__).with_name("csrc") / "gemv_int8.c"
INT8_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-fopenmp")
INT8_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
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


@dataclass(frozen=True)
class GemvInt8:
    """y = (x @ q^T) * scales for int8 q [out, k], x [rows, k], scales [out] and y [rows, out]
    in one dtype, float32 or bfloat16; contiguous."""

    library: ctypes.CDLL
    path: Path

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # (a no-op for the fast step's inputs; the kernel reads raw rows)
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
        failed = self.library.kenspec_gemv_int8(
            x.data_ptr(), weight.data_ptr(), scales.data_ptr(), out.data_ptr(),
            rows, k, weight.shape[0], int(x.dtype == torch.bfloat16),
        )  # fmt: skip
        if failed:
            raise MemoryError("kenspec_gemv_int8: no memory for the widened activations")
        return out


@cache
def load() -> Gemv | None:
    """The compiled bfloat16 kernel, built once per machine and source; None where it cannot
    run."""
    if "avx512_bf16" not in cpu_flags():
        return None
    built = _library(SOURCE, FLAGS)
    if built is None:
        return None
    function = built[0].kenspec_gemv_bf16
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    return Gemv(*built)


@cache
def load_int8() -> GemvInt8 | None:
    """The compiled int8 kernel, built once per machine and source; None where it cannot run
    (a CPU without AVX-512 F/BW/VL/DQ, as many AMD ones before Zen 4: torch's kernel then)."""
    if not INT8_CPU_FLAGS.issubset(cpu_flags()):
        return None
    built = _library(INT8_SOURCE, INT8_FLAGS)
    if built is None:
        return None
    function = built[0].kenspec_gemv_int8
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    return GemvInt8(*built)


def _library(source: Path, flags: tuple[str, ...]) -> tuple[ctypes.CDLL, Path] | None:
    """The source compiled with flags, loaded, and its path; None (and a warning) where that
    fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("gemv_unavailable", source=source.name, reason="no C compiler (cc or gcc)")
        return None
    try:
        path = _build(compiler, source, flags)
        return ctypes.CDLL(str(path)), path
    except (OSError, subprocess.CalledProcessError) as error:
        log.warning("gemv_unavailable", source=source.name, reason=str(error))
        return None


def _build(compiler: str, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library for this source, compiler and flags, built if not cached."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), compiler, version, *flags]).encode()
    ).hexdigest()[:16]
    target = CACHE / key / f"{source.stem}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run(
            [compiler, *flags, "-shared", "-fPIC", str(source), "-o", str(built)],
            capture_output=True,
            text=True,
            check=True,
        )
        built.replace(target)  # atomic: a concurrent start-up loads one or the other
    log.info("gemv_built", path=str(target))
    return target

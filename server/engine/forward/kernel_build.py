"""How kenspec's C kernels (../csrc) are built: each source compiled once with the instructions
it needs, all linked into one libkenspec.so, and beside it build.json, the record of what was
built (`Build`). One recipe for both builders: setup.py, which ships the library in the wheel
(forward/_prebuilt/<key>/), and forward.cpu_kernels, which compiles it at start-up where no
shipped library serves (into its cache, the same layout).

A compiler that lacks an instruction set's flag builds the rest: the instruction set whose
sources failed is left out of the library, and the record says why. Only a failure of the
any-x86-64 source or of the link is a `BuildError`.

This module imports nothing of kenspec's and no torch: setup.py loads it by its file path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

SOURCES = Path(__file__).resolve().parent.parent / "csrc"
LIBRARY = "libkenspec.so"
RECORD = "build.json"
FORMAT = 1  # build.json's layout


class Isa(StrEnum):
    """The instruction sets a source of the library is compiled for (its name: the
    /proc/cpuinfo flag it adds to AVX-512 F/BW/VL/DQ; AVX2's, the flag it needs with FMA and
    F16C)."""

    AVX2 = "avx2"  # with FMA: bf16 and grouped GEMVs, layer kernels where AVX512-BF16 is not
    AVX512 = "avx512"  # F, BW, VL, DQ: int8 weights with float32 activations
    BF16 = "avx512_bf16"  # bfloat16 products and the layer kernels
    VNNI = "avx512_vnni"  # the screened output layer's int8 x int8 product
    AMX = "amx_bf16"  # with AMX-TILE and AVX512-BF16: the decoder's bf16 products in tiles


_BASE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
# The /proc/cpuinfo flags a CPU needs to run each instruction set's sources.
CPU_FLAGS = {
    Isa.AVX2: frozenset({"avx2", "fma", "f16c"}),
    Isa.AVX512: _BASE,
    Isa.BF16: _BASE | {"avx512_bf16"},
    Isa.VNNI: _BASE | {"avx512_vnni"},
    Isa.AMX: _BASE | {"avx512_bf16", "amx_bf16", "amx_tile"},
}
# What a CPU without an instruction set loses (for the log).
USES = {
    Isa.AVX2: "AVX2 bf16 and grouped GEMV and layer kernels",
    Isa.AVX512: "int8 GEMV",
    Isa.BF16: "bf16 GEMV, layer kernels and decoder pass",
    Isa.VNNI: "int8 screen of the output layer",
    Isa.AMX: "AMX bf16 products",
}
_AVX512 = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
COMPILER_FLAGS: dict[Isa | None, tuple[str, ...]] = {
    None: ("-O3",),
    Isa.AVX2: ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"),
    Isa.AVX512: _AVX512,
    Isa.BF16: (*_AVX512, "-mavx512bf16"),
    Isa.VNNI: (*_AVX512, "-mavx512vnni"),
    Isa.AMX: (*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
}
# Each source once, with what it needs (None: any x86-64). Sources of one instruction set may
# call each other (step.c calls gemv.c and layer.c), never another set's: the link checks it.
UNITS: tuple[tuple[str, Isa | None], ...] = (
    ("gemv_int8.c", Isa.AVX512),
    ("gemv.c", Isa.BF16),
    ("gemv_grouped.c", Isa.BF16),
    ("gemv_avx2.c", Isa.AVX2),
    ("gemv_grouped_avx2.c", Isa.AVX2),
    ("layer_avx2.c", Isa.AVX2),
    ("layer.c", Isa.BF16),
    ("step.c", Isa.BF16),
    ("gemv_u8s8.c", Isa.VNNI),
    ("gemv_amx.c", Isa.AMX),
    ("layout.c", None),
    ("norms.c", None),
    ("head.c", None),
)


class BuildError(RuntimeError):
    """No library could be built (the any-x86-64 source or the link failed)."""


@dataclass(frozen=True)
class Unit:
    """One source as it was compiled: its instruction set, flags and the compiler's error
    ("" where it compiled)."""

    source: str
    isa: Isa | None
    flags: tuple[str, ...]
    error: str = ""


@dataclass(frozen=True)
class Build:
    """build.json: what a library was built from, with what, and which instruction sets it
    holds (those all of whose sources compiled)."""

    source_hash: str  # `source_hash()` of the sources and recipe it was built from
    key: str  # its directory's name: the sources, recipe and compiler (`build_key`)
    compiler: str
    version: str  # the compiler's first line of --version
    units: tuple[Unit, ...]

    @property
    def isa(self) -> frozenset[Isa]:
        failed = {unit.isa for unit in self.units if unit.error}
        return frozenset(unit.isa for unit in self.units if unit.isa and unit.isa not in failed)

    def missing(self) -> dict[Isa, str]:
        """Each instruction set left out of the library, and its first source's error."""
        out: dict[Isa, str] = {}
        for unit in self.units:
            if unit.error and unit.isa is not None:
                out.setdefault(unit.isa, f"{unit.source}: {unit.error}")
        return out

    def to_json(self) -> str:
        units = [
            {"source": u.source, "isa": u.isa, "flags": list(u.flags), "error": u.error}
            for u in self.units
        ]
        record = {
            "format": FORMAT,
            "source_hash": self.source_hash,
            "key": self.key,
            "compiler": self.compiler,
            "version": self.version,
            "isa": sorted(self.isa),
            "units": units,
        }
        return json.dumps(record, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Build:
        """The record; ValueError where it is not one this module writes."""
        try:
            record: dict[str, Any] = json.loads(text)
            if record.get("format") != FORMAT:
                raise ValueError(f"build.json format {record.get('format')!r}, not {FORMAT}")
            units = tuple(
                Unit(u["source"], None if u["isa"] is None else Isa(u["isa"]), tuple(u["flags"]),
                     u["error"])
                for u in record["units"]
            )  # fmt: skip
            return cls(
                record["source_hash"], record["key"], record["compiler"], record["version"], units
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"build.json lacks {error}") from error


def source_hash(sources: Path = SOURCES) -> str:
    """The sources' (every .c and .h, by name) and the recipe's (units and flags) SHA-256:
    a shipped library serves sources with this hash only."""
    digest = hashlib.sha256()
    for path in sorted([*sources.glob("*.c"), *sources.glob("*.h")]):
        digest.update(f"{path.name}\0{len(path.read_bytes())}\0".encode())
        digest.update(path.read_bytes())
    for source, isa in UNITS:
        digest.update(f"{source}\0{isa}\0{' '.join(COMPILER_FLAGS[isa])}\0".encode())
    return digest.hexdigest()


def find_compiler() -> str | None:
    """$CC (default cc), else gcc, as found on PATH; None where neither is."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def compiler_version(compiler: str) -> str:
    """The compiler's whole --version output (OSError or CalledProcessError where it fails)."""
    return subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout


def build_key(hashed: str, compiler: str, version: str) -> str:
    """A build's directory name: its sources and recipe (`source_hash`) and its compiler."""
    return hashlib.sha256("\0".join([hashed, compiler, version]).encode()).hexdigest()[:16]


def build(directory: Path, compiler: str, sources: Path = SOURCES) -> Build:
    """Compile every unit (in parallel) and link those of the instruction sets that all
    compiled into directory/libkenspec.so, with directory/build.json; the record."""
    version = compiler_version(compiler)
    hashed = source_hash(sources)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        objects = [Path(scratch) / f"{source}.o" for source, _ in UNITS]
        compiles = []
        for (source, isa), obj in zip(UNITS, objects, strict=True):
            command = [compiler, *COMPILER_FLAGS[isa], f"-I{sources}", "-fPIC", "-c"]
            command += [str(sources / source), "-o", str(obj)]
            compiles.append(
                subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        units = []
        for process, (source, isa) in zip(compiles, UNITS, strict=True):
            _, errors = process.communicate()
            error = "" if process.returncode == 0 else _tail(errors) or f"exit {process.returncode}"
            units.append(Unit(source, isa, COMPILER_FLAGS[isa], error))
        record = Build(
            hashed, build_key(hashed, compiler, version), compiler, _first_line(version),
            tuple(units),
        )  # fmt: skip
        for unit in units:
            if unit.error and unit.isa is None:
                raise BuildError(f"{unit.source}: {unit.error}")
        linked = [
            str(obj)
            for unit, obj in zip(units, objects, strict=True)
            if unit.isa is None or unit.isa in record.isa
        ]
        built = Path(scratch) / LIBRARY
        # -z defs: a symbol of a source left out fails here, not at load
        link = subprocess.run(
            [compiler, "-shared", "-fopenmp", "-Wl,-z,defs", *linked, "-lm", "-o", str(built)],
            capture_output=True, text=True,
        )  # fmt: skip
        if link.returncode:
            raise BuildError(f"link failed: {_tail(link.stderr)}")
        built.replace(directory / LIBRARY)
    (directory / RECORD).write_text(record.to_json())
    return record


def cached_build(cache: Path, compiler: str, sources: Path = SOURCES) -> tuple[Path, Build, bool]:
    """The library for these sources and this compiler under cache/<key>/, built there first
    where it is not; (its directory, its record, whether it was already there)."""
    hashed = source_hash(sources)
    directory = cache / build_key(hashed, compiler, compiler_version(compiler))
    if (directory / LIBRARY).exists() and (directory / RECORD).exists():
        return directory, read_record(directory), True
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=cache, prefix=".build-"))
    try:
        record = build(scratch, compiler, sources)
        try:
            scratch.rename(directory)  # atomic: a concurrent start-up's build wins, or ours
        except OSError:
            if not (directory / RECORD).exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory, record, False


def read_record(directory: Path) -> Build:
    """directory/build.json (OSError where absent, ValueError where not a record)."""
    return Build.from_json((directory / RECORD).read_text())


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _tail(text: str, limit: int = 600) -> str:
    return text.strip()[-limit:]

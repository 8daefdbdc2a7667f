"""The C kernels built at install: one recipe (forward.kernel_build) for the wheel's library and
the start-up compile; load_kernels takes the wheel's library where it was built from the
sources it ships, without a compiler, and says in one log line which library runs and why."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import structlog
import torch

from kenspec.server.engine.forward import cpu_kernels, kernel_build
from kenspec.server.engine.forward.cpu_kernels import KernelUnavailable, load_kernels
from kenspec.server.engine.forward.kernel_build import CPU_FLAGS, SOURCES, Isa

REPO = Path(__file__).resolve().parents[3]
COMPILER = kernel_build.find_compiler()
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler here")
ALL_FLAGS = frozenset().union(*CPU_FLAGS.values())
REAL_BF16 = Isa.BF16 in cpu_kernels.supported_isa(cpu_kernels.cpu_flags())
REAL_AVX2 = Isa.AVX2 in cpu_kernels.supported_isa(cpu_kernels.cpu_flags())


def prebuild(root: Path, compiler: str | None = COMPILER, sources: Path = SOURCES) -> Path:
    """A library built as setup.py builds the wheel's: root/<key>/ (its directory)."""
    assert compiler is not None
    record = kernel_build.build(root / "building", compiler, sources)
    directory = root / record.key
    (root / "building").rename(directory)
    return directory


@pytest.fixture
def loading(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """load_kernels with its prebuilt folder and cache in tmp_path, the CPU's flags as given
    (default: every instruction set's); yields a function that loads and returns the kernels
    and the "kernels" log lines."""
    monkeypatch.setattr(cpu_kernels, "PREBUILT", tmp_path / "prebuilt")
    monkeypatch.setattr(cpu_kernels, "CACHE", tmp_path / "cache")
    # (flags that fake AMX: Linux's grant of the tile state faked too, so a CPU without it
    # loads as one with it would; no AMX kernel is called here)
    monkeypatch.setattr(cpu_kernels, "grant_amx", lambda library: True)

    def load(flags: frozenset[str] = ALL_FLAGS) -> tuple[cpu_kernels.CpuKernels | None, list]:
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
        load_kernels.cache_clear()
        with structlog.testing.capture_logs() as logs:
            kernels = load_kernels()
        return kernels, [line for line in logs if line["event"] == "kernels"]

    yield load
    load_kernels.cache_clear()


def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """PATH with nothing on it, no $CC: no compiler is found."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    assert kernel_build.find_compiler() is None


def test_the_recipe_loads_without_torch_or_kenspec() -> None:
    """setup.py loads the recipe by its path, in a process without torch (build isolation)."""
    recipe = str(SOURCES.parent / "forward" / "kernel_build.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('recipe', {recipe!r})\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['recipe'] = module\n"
        "spec.loader.exec_module(module)\n"
        "assert not {'torch', 'kenspec'} & set(sys.modules), sorted(sys.modules)\n"
        "print(module.source_hash())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == kernel_build.source_hash()


def test_the_source_hash_follows_every_source_and_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = shutil.copytree(SOURCES, tmp_path / "csrc")
    assert kernel_build.source_hash(copy) == kernel_build.source_hash()
    (copy / "simd.h").write_text((copy / "simd.h").read_text() + "\n")  # a header counts
    changed = kernel_build.source_hash(copy)
    assert changed != kernel_build.source_hash()
    flags = {**kernel_build.COMPILER_FLAGS, Isa.BF16: ("-O2",)}
    monkeypatch.setattr(kernel_build, "COMPILER_FLAGS", flags)
    assert kernel_build.source_hash(copy) != changed  # so does a flag


@needs_compiler
def test_a_prebuilt_library_runs_without_a_compiler(
    loading, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No compiler on PATH, the wheel's library of these sources present: it is loaded (no
    build, nothing cached) with every instruction set, the bf16 GEMV among them, and the log
    line says so."""
    directory = prebuild(tmp_path / "prebuilt")
    record = kernel_build.read_record(directory)
    assert record.isa == set(Isa) and record.source_hash == kernel_build.source_hash()
    no_compiler(monkeypatch, tmp_path)
    kernels, (line,) = loading()
    assert kernels is not None and kernels.source == "prebuilt" and kernels.bf16
    assert kernels.path == directory / "libkenspec.so"
    assert not (tmp_path / "cache").exists()
    assert line["source"] == "prebuilt" and line["library"] == str(kernels.path)
    assert line["isa"] == ["amx_bf16", "avx2", "avx512", "avx512_bf16", "avx512_vnni"]
    assert line["build"] == record.key and line["reason"] == "all of it runs here"
    if REAL_BF16:  # the GEMV itself, where this CPU runs it
        x, weight = torch.randn(3, 256).bfloat16(), torch.randn(40, 256).bfloat16()
        expected = (x.float() @ weight.float().t()).bfloat16()
        torch.testing.assert_close(kernels.gemv(x, weight), expected)


@needs_compiler
def test_a_cpu_without_bf16_gets_the_rest_and_the_log_says_what_is_not_used(
    loading, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    prebuild(tmp_path / "prebuilt")
    no_compiler(monkeypatch, tmp_path)
    kernels, (line,) = loading(CPU_FLAGS[Isa.AVX512])  # (no AVX2: a CPU that does not exist)
    assert kernels is not None and kernels.isa == {Isa.AVX512} and not kernels.gemv_bf16
    assert line["source"] == "prebuilt" and line["isa"] == ["avx512"]
    assert "CPU lacks avx512_bf16: bf16 GEMV, layer kernels" in line["reason"]
    assert "CPU lacks avx512_vnni" in line["reason"]
    with pytest.raises(KernelUnavailable, match="avx512_bf16, which this CPU lacks"):
        kernels.gemv(torch.zeros(1, 32).bfloat16(), torch.zeros(4, 32).bfloat16())
    # AVX-512 without BF16 (Skylake-SP, Cascade Lake): the bf16 GEMV is AVX2's
    kernels, (line,) = loading(CPU_FLAGS[Isa.AVX512] | {"avx2", "fma", "f16c"})
    assert kernels is not None and kernels.isa == {Isa.AVX2, Isa.AVX512}
    assert kernels.gemv_bf16 and not kernels.bf16
    assert line["isa"] == ["avx2", "avx512"]
    assert line["reason"].startswith("AVX2 bf16 and grouped GEMV and layer kernels; ")
    assert "CPU lacks avx512_bf16: int8 screen not used" in line["reason"]
    assert "CPU lacks amx_bf16: AMX bf16 products not used" in line["reason"]
    if REAL_AVX2:
        x, weight = torch.randn(3, 40).bfloat16(), torch.randn(9, 40).bfloat16()
        assert torch.equal(kernels.gemv(x, weight), (x.double() @ weight.double().t()).bfloat16())
    kernels, (line,) = loading(frozenset({"avx2", "fma", "f16c"}))  # no AVX-512 at all
    assert kernels is not None and kernels.isa == {Isa.AVX2} and line["isa"] == ["avx2"]
    kernels, (line,) = loading(frozenset({"avx", "sse4_2"}))  # nor AVX2
    assert kernels is None and line["source"] == "none"
    assert line["reason"].startswith("CPU lacks AVX-512")


@needs_compiler
def test_a_prebuilt_library_of_other_sources_is_not_used(
    loading, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A library whose record names other sources than those shipped beside it is not
    loaded: the start-up compile takes over, or, without a compiler, no kernels; the log line
    says why either way."""
    sources = shutil.copytree(SOURCES, tmp_path / "csrc")
    (sources / "gemv.c").write_text((sources / "gemv.c").read_text() + "/* changed */\n")
    stale = prebuild(tmp_path / "prebuilt", sources=sources)
    kernels, (line,) = loading()
    assert kernels is not None and kernels.source == "compiled"
    assert kernels.path.parent.parent == tmp_path / "cache"
    assert line["source"] == "compiled"
    assert f"prebuilt {stale.name} not used: built from other sources" in line["reason"]
    kernels, (line,) = loading()  # the next start-up: the cache
    assert kernels is not None and line["source"] == "cache"
    no_compiler(monkeypatch, tmp_path)
    kernels, (line,) = loading()
    assert kernels is None and line["source"] == "none" and line["log_level"] == "warning"
    assert "built from other sources" in line["reason"]
    assert "no C compiler on PATH" in line["reason"]


def test_no_compiler_and_no_prebuilt_library_is_said(
    loading, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_compiler(monkeypatch, tmp_path)
    kernels, (line,) = loading()
    assert kernels is None and line["source"] == "none"
    assert line["reason"] == "no prebuilt library; no C compiler on PATH ($CC, cc or gcc)"


@needs_compiler
def test_a_compiler_without_a_flag_builds_the_other_instruction_sets(
    loading, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A compiler that does not know -mavx512vnni: the library holds the rest, its record
    names the failed source, and the screen's kernel refuses instead of being missing."""
    old = tmp_path / "old-cc"
    old.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -mavx512vnni ] && '
        "echo \"cc: error: unrecognized command-line option '$a'\" >&2 && exit 1; done\n"
        f'exec {COMPILER} "$@"\n'
    )
    old.chmod(0o755)
    directory = prebuild(tmp_path / "prebuilt", compiler=str(old))
    record = json.loads((directory / "build.json").read_text())
    assert record["isa"] == ["amx_bf16", "avx2", "avx512", "avx512_bf16"]
    (failed,) = [unit for unit in record["units"] if unit["error"]]
    assert failed["source"] == "gemv_u8s8.c" and "-mavx512vnni" in failed["error"]
    kernels, (line,) = loading()
    assert kernels is not None and kernels.bf16 and not kernels.vnni
    assert line["source"] == "prebuilt"
    assert line["isa"] == ["amx_bf16", "avx2", "avx512", "avx512_bf16"]
    assert "library built without avx512_vnni (gemv_u8s8.c: cc: error" in line["reason"]
    values = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(KernelUnavailable, match="avx512_vnni, which the library was built"):
        kernels.u8s8_prepare(values, torch.ones(4).bfloat16())


@needs_compiler
@pytest.mark.parametrize("how", ["failed", "older"])
def test_a_library_without_the_avx2_gemv_is_loaded_for_the_rest(
    how: str, loading, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A library whose record holds no AVX2 (failed: a compiler without -mavx2; older: a
    recipe before gemv_avx2.c and layer_avx2.c, e.g. a wheel built then): an AVX2-only CPU
    runs none of it and keeps torch's kernels; a CPU with AVX-512 but not BF16 its int8 GEMV,
    `gemv` refusing."""
    if how == "failed":
        cc = tmp_path / "old-cc"
        cc.write_text(
            "#!/bin/sh\n"
            'for a in "$@"; do [ "$a" = -mavx2 ] && '
            "echo \"cc: error: unrecognized command-line option '$a'\" >&2 && exit 1; done\n"
            f'exec {COMPILER} "$@"\n'
        )
        cc.chmod(0o755)
        directory = prebuild(tmp_path / "prebuilt", compiler=str(cc))
    else:
        directory = prebuild(tmp_path / "prebuilt")
        record = json.loads((directory / "build.json").read_text())
        record["units"] = [u for u in record["units"] if u["isa"] != "avx2"]
        record["isa"] = [isa for isa in record["isa"] if isa != "avx2"]
        (directory / "build.json").write_text(json.dumps(record))
    assert Isa.AVX2 not in kernel_build.read_record(directory).isa
    no_compiler(monkeypatch, tmp_path)
    kernels, (line,) = loading(frozenset({"avx2", "fma", "f16c"}))
    assert kernels is None and line["source"] == "none"
    built_without = "(gemv_avx2.c: cc: error" if how == "failed" else "(no source of it)"
    assert f"library built without avx2 {built_without}" in line["reason"]
    assert line["reason"].endswith("none of the library runs on this CPU")
    kernels, (line,) = loading(CPU_FLAGS[Isa.AVX512] | {"avx2", "fma", "f16c"})
    assert kernels is not None and kernels.isa == {Isa.AVX512} and not kernels.gemv_bf16
    assert "library built without avx2" in line["reason"]
    with pytest.raises(KernelUnavailable, match="avx512_bf16, which this CPU lacks"):
        kernels.gemv(torch.zeros(1, 32).bfloat16(), torch.zeros(4, 32).bfloat16())
    with pytest.raises(KernelUnavailable, match="avx2, which the library was built without"):
        kernels.gemv_avx2(torch.zeros(1, 32).bfloat16(), torch.zeros(4, 32).bfloat16())


@needs_compiler
def test_the_any_x86_64_code_needs_no_avx512(tmp_path: Path) -> None:
    """The library loads on any x86-64 (its load runs kenspec_layout): that function holds no
    AVX-512 instruction and the library declares no x86 ISA level a loader would enforce."""
    objdump, readelf = shutil.which("objdump"), shutil.which("readelf")
    if objdump is None or readelf is None:
        pytest.skip("no binutils here")
    library = prebuild(tmp_path) / "libkenspec.so"
    code = subprocess.run(
        [objdump, "-d", "--disassemble=kenspec_layout", str(library)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "<kenspec_layout>:" in code
    assert "zmm" not in code and "ymm" not in code and "%k" not in code
    notes = subprocess.run([readelf, "-n", str(library)], capture_output=True, text=True).stdout
    assert "ISA needed" not in notes


def _tree(destination: Path) -> None:
    """The repository's files (tracked and new, not ignored) copied as they are, links too."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO, capture_output=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for name in listed.decode().split("\0"):
        source = REPO / name
        if not name or not os.path.lexists(source) or (source.is_dir() and not source.is_symlink()):
            continue
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination / name, follow_symlinks=False)


@needs_compiler
@pytest.mark.timeout(120)
def test_the_wheel_holds_the_library_and_kenspec_alone(tmp_path: Path) -> None:
    """`pip wheel .` of the repository: kenspec/ and its dist-info only (no server/, client/,
    harness/ or tests at its root), the csrc/ sources and the library built from them, with
    its record; tagged for the platform, not for a Python ABI."""
    tree = tmp_path / "tree"
    _tree(tree)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
         "--no-cache-dir", "-q", "-w", str(tmp_path / "dist")],
        cwd=tree, capture_output=True, text=True, check=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl")
    names = zipfile.ZipFile(wheel).namelist()
    roots = {name.split("/")[0] for name in names}
    (info,) = roots - {"kenspec"}
    assert re.fullmatch(r"kenspec-[\d.]+\.dist-info", info), roots
    assert not [name for name in names if {"tests", "harness"} & set(name.split("/"))]
    assert not [name for name in names if name.startswith("kenspec/__init__")]  # namespace
    prebuilt = [name for name in names if "/_prebuilt/" in name]
    (library,) = [name for name in prebuilt if name.endswith("/libkenspec.so")]
    record = json.loads(zipfile.ZipFile(wheel).read(library.replace("libkenspec.so", "build.json")))
    assert library == f"kenspec/server/engine/forward/_prebuilt/{record['key']}/libkenspec.so"
    assert len(prebuilt) == 2
    assert record["source_hash"] == kernel_build.source_hash()
    assert {u["source"] for u in record["units"]} == {p.name for p in SOURCES.glob("*.c")}
    assert all(f"kenspec/server/engine/csrc/{p.name}" in names for p in SOURCES.iterdir())

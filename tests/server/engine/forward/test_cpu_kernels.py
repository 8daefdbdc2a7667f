"""The C kernel library: every source compiled once into one shared object, and the structs a
decoder pass crosses with checked against their C declarations at load."""

from __future__ import annotations

import ctypes

import pytest

from server.engine.forward import cpu_kernels
from server.engine.forward.cpu_kernels import (
    DecoderLayer,
    Isa,
    LayoutMismatch,
    PassArgs,
    check_layout,
    load_kernels,
    supported_isa,
)

KERNELS = load_kernels()
needs_library = pytest.mark.skipif(KERNELS is None, reason="no AVX-512 (or no compiler) here")


def test_every_source_is_compiled_once_into_one_library() -> None:
    sources = sorted(path.name for path in cpu_kernels.SOURCES.glob("*.c"))
    units = [name for name, _ in cpu_kernels._UNITS]
    assert sorted(units) == sources and len(set(units)) == len(units)


def test_the_instruction_sets_follow_the_cpus_flags() -> None:
    base = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert supported_isa(frozenset({"avx2", "fma"})) == frozenset()
    assert supported_isa(frozenset(base)) == {Isa.AVX512}
    assert supported_isa(frozenset(base | {"avx512_bf16", "avx512_vnni"})) == set(Isa)
    assert supported_isa(frozenset({"avx512_bf16"})) == frozenset()  # (needs the base too)


@needs_library
def test_the_ctypes_structs_match_the_c_declarations() -> None:
    assert KERNELS is not None
    check_layout(KERNELS.library)  # (load_kernels checked it too)
    assert ctypes.sizeof(PassArgs) > len(PassArgs._fields_) * 4


@needs_library
@pytest.mark.parametrize("which", ["layer", "pass"])
def test_a_member_added_on_one_side_only_fails_at_load(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mirror with one member more, or with two members swapped in type, no longer matches
    kenspec_layout's sizes and offsets: LayoutMismatch, not a shifted pointer at run time."""
    assert KERNELS is not None
    original = DecoderLayer if which == "layer" else PassArgs
    name = "DecoderLayer" if which == "layer" else "PassArgs"
    extra = type(
        name, (ctypes.Structure,), {"_fields_": [*original._fields_, ("x", ctypes.c_long)]}
    )
    monkeypatch.setattr(cpu_kernels, name, extra)
    with pytest.raises(LayoutMismatch, match=name):
        check_layout(KERNELS.library)
    if which == "pass":  # int8 (an int) and eps (a float) read as one long: offsets move
        fields = list(original._fields_)
        at = [field[0] for field in fields].index("int8")
        fields[at : at + 2] = [("int8", ctypes.c_long)]
        short = type(name, (ctypes.Structure,), {"_fields_": fields})
        monkeypatch.setattr(cpu_kernels, name, short)
        with pytest.raises(LayoutMismatch):
            check_layout(KERNELS.library)

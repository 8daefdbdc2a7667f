"""The C kernel library: every source compiled once into one shared object, and the structs a
decoder pass crosses with checked against their C declarations at load."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kenspec.server.engine.forward import cpu_kernels, kernel_build
from kenspec.server.engine.forward.cpu_kernels import (
    DecoderLayer,
    HeadArgs,
    Isa,
    LayoutMismatch,
    PassArgs,
    check_layout,
    load_kernels,
    supported_isa,
)

KERNELS = load_kernels()
needs_library = pytest.mark.skipif(KERNELS is None, reason="no AVX-512 or AVX2 (or no compiler)")


def test_every_source_is_compiled_once_into_one_library() -> None:
    sources = sorted(path.name for path in cpu_kernels.SOURCES.glob("*.c"))
    units = [name for name, _ in kernel_build.UNITS]
    assert sorted(units) == sources and len(set(units)) == len(units)


def test_the_instruction_sets_follow_the_cpus_flags() -> None:
    base = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert supported_isa(frozenset({"avx2", "fma", "f16c"})) == {Isa.AVX2}
    assert supported_isa(frozenset({"avx", "avx2"})) == frozenset()  # (AVX2 needs FMA too)
    assert supported_isa(frozenset({"avx2", "fma"})) == frozenset()  # (and F16C)
    assert supported_isa(frozenset(base)) == {Isa.AVX512}
    every = base | {"avx2", "fma", "f16c", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}
    assert supported_isa(frozenset(every)) == set(Isa)
    assert supported_isa(frozenset({"avx512_bf16"})) == frozenset()  # (needs the base too)


@needs_library
def test_the_ctypes_structs_match_the_c_declarations() -> None:
    assert KERNELS is not None
    check_layout(KERNELS.library)  # (load_kernels checked it too)
    assert ctypes.sizeof(PassArgs) > len(PassArgs._fields_) * 4


@needs_library
@pytest.mark.parametrize("which", ["layer", "pass", "head"])
def test_a_member_added_on_one_side_only_fails_at_load(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mirror with one member more, or with two members swapped in type, no longer matches
    kenspec_layout's sizes and offsets: LayoutMismatch, not a shifted pointer at run time."""
    assert KERNELS is not None
    original = {"layer": DecoderLayer, "pass": PassArgs, "head": HeadArgs}[which]
    name = original.__name__
    extra = type(
        name, (ctypes.Structure,), {"_fields_": [*original._fields_, ("x", ctypes.c_long)]}
    )
    monkeypatch.setattr(cpu_kernels, name, extra)
    with pytest.raises(LayoutMismatch, match=name):
        check_layout(KERNELS.library)
    if which == "pass":  # quant (an int) and eps (a float) read as one long: offsets move
        fields = list(original._fields_)
        at = [field[0] for field in fields].index("quant")
        fields[at : at + 2] = [("quant", ctypes.c_long)]
        short = type(name, (ctypes.Structure,), {"_fields_": fields})
        monkeypatch.setattr(cpu_kernels, name, short)
        with pytest.raises(LayoutMismatch):
            check_layout(KERNELS.library)


@pytest.mark.skipif(KERNELS is None or not KERNELS.bf16, reason="the CPU has no avx512_bf16")
@pytest.mark.parametrize("k", [576, 77])
def test_exact_candidates_are_the_gemvs_bits_and_their_first_best(k: int) -> None:
    """A screened row's candidates (any count, in blocks of 16 and a tail) get the logits the
    GEMV computes for them, bit for bit; the best is the earliest of equal ones."""
    assert KERNELS is not None
    generator = torch.Generator().manual_seed(k)
    weight = torch.randn(300, k, generator=generator).bfloat16()
    weight[250] = weight[40]  # an exact tie: 40 first
    x = torch.randn(k, generator=generator).bfloat16()
    exact = KERNELS.gemv(x[None], weight)[0].float()
    top = int(exact.argmax())
    for candidates in ([5], [3, 40, 99, 250], list(range(0, 300, 7)), [top, *range(280, 299)]):
        found = torch.tensor(sorted(set(candidates)), dtype=torch.int32)
        row = torch.full((300,), -1e30)
        best = KERNELS.exact_candidates(x, weight, found, row)
        chosen = found.long()
        assert torch.equal(row[chosen], exact[chosen])
        assert (row == -1e30).sum() == 300 - len(found)  # nothing else written
        assert best == int(chosen[int(exact[chosen].argmax())])
    forty = torch.tensor([40, 250], dtype=torch.int32)
    x = weight[40].clone()  # along the duplicated row: 40 and 250 tie at the top
    assert KERNELS.exact_candidates(x, weight, forty, torch.zeros(300)) == 40

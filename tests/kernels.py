"""The kernel library as a test of one instruction set's kernels sees it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kenspec.server.engine.forward.cpu_kernels import CpuKernels, Isa, load_kernels


def one_isa(isa: Isa) -> CpuKernels:
    """The library with `isa`'s kernels in use: AVX512-BF16's as loaded, or AVX2's as a CPU
    without AVX512-BF16 sees the library (a restricted view, so an AVX-512 machine runs AVX2's
    code too); the test is skipped where this CPU does not run `isa`."""
    kernels = load_kernels()
    if kernels is None or isa not in kernels.isa:
        pytest.skip(f"this CPU does not run {isa}'s kernels")
    return replace(kernels, isa=frozenset({isa})) if isa is Isa.AVX2 else kernels

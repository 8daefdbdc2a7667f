"""The AVX2 grouped GEMV before and after (csrc/gemv_grouped_avx2.c at two commits), in one
process, interleaved: 30 SmolLM2-135M-shaped layers (qkv 960x576, out 576x576, gate_up
3072x576, down 576x1536) of random 4-bit (Q4_1: scales and offsets) or int8 (Q8_0: scales)
groups of 32 with float16 factors, streamed (30 distinct layers, 66/113 MB) and hot (one
layer's four products 30 times, from cache); medians of 9 repeats, ms a stack.

    git show <before>:server/engine/csrc/gemv_grouped_avx2.c > /tmp/old_grouped.c
    for v in old new; do src=...; gcc -O3 -fopenmp -mavx2 -mfma -mf16c \\
        -Iserver/engine/csrc -shared -fPIC $src -o /tmp/lib$v.so; done
    OMP_NUM_THREADS=2 .venv/bin/python bench/results/gguf-avx2-int16/kernel_ab.py 4 /tmp
"""

import ctypes
import statistics
import sys
import time

import torch

from kenspec.server.engine.quantize import GroupedWeight

BITS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
LIBS = sys.argv[2] if len(sys.argv) > 2 else "/tmp"
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
_P, _L = ctypes.c_void_p, ctypes.c_long


def load(version: str) -> ctypes._CFuncPtr:
    function = ctypes.CDLL(f"{LIBS}/lib{version}.so").kenspec_gemv_grouped_avx2
    function.restype = ctypes.c_int
    function.argtypes = [_P] * 5 + [_L, _P] + [_L] * 3 + [ctypes.c_int]
    return function


def make(out: int, k: int) -> GroupedWeight:
    if BITS == 4:
        q = torch.randint(0, 16, (out, k), dtype=torch.int8)
    else:
        q = torch.randint(-127, 128, (out, k), dtype=torch.int8)
    scales = torch.rand(out, k // 32).half().float()
    mins = torch.rand(out, k // 32).half().float() if BITS == 4 else None
    return GroupedWeight.of(q, scales, mins, 32, BITS, "Q", half=True)


def run(function, stack, rows: int, xs: dict) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    for layer in stack:
        for w in layer:
            x, out = xs[w.shape[1]], torch.empty(rows, w.shape[0], dtype=torch.bfloat16)
            mins = None if w.mins is None else w.mins.data_ptr()
            function(x.data_ptr(), w.values.data_ptr(), w.bits, w.scales.data_ptr(), mins,
                     w.group, out.data_ptr(), rows, w.shape[1], w.shape[0], 1)  # fmt: skip
    return time.perf_counter() - started


def main() -> None:
    torch.manual_seed(0)
    functions = {version: load(version) for version in ("old", "new")}
    layers = [[make(*shape) for shape in SHAPES] for _ in range(30)]
    print(f"{BITS}-bit groups, ms a stack of 30 layers (median of 9)")
    for rows in (1, 2, 4, 7, 12):
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        times: dict[str, list[float]] = {}
        for _ in range(9):
            for version, function in functions.items():
                times.setdefault(f"{version}/streamed", []).append(run(function, layers, rows, xs))
                hot = [layers[0]] * 30
                times.setdefault(f"{version}/hot", []).append(run(function, hot, rows, xs))
        cells = "  ".join(f"{name} {statistics.median(t) * 1e3:.2f}" for name, t in times.items())
        print(f"rows {rows}: {cells}")


if __name__ == "__main__":
    main()

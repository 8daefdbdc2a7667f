"""The decoder's grouped products alone, several builds of the kernel library in one process,
interleaved: 30 SmolLM2-sized layers' worth of distinct 4-bit weights (qkv 960 x 576, out
576 x 576, gate_up 3072 x 576, down 576 x 1536; Q4_1-like: groups of 32, float16 scales and
offsets), passes of 1, 2, 4 and 8 rows, medians of 12 (ms for the 120 products). A build is
NAME=LIBRARY[:quads] (the 4-bit values laid out in quads of k for it, else in pairs); a
library is a kernel cache's build (~/.cache/kenspec/kernels/<hash>/libkenspec.so) or
gemv_grouped_avx2.c compiled alone (cc -O3 -fopenmp -mavx2 -mfma -mf16c -shared -fPIC).

    .venv/bin/python bench/results/gguf-avx2-q8-activations/kernel_ab.py \
        pairs=/tmp/libp.so quads=/tmp/libq.so:quads
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch

from kenspec.server.engine.quantize import GroupedWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
P, L, INT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def product(path: str) -> ctypes._CFuncPtr:
    function = ctypes.CDLL(path).kenspec_gemv_grouped_avx2
    function.restype = INT
    function.argtypes = [P, P, INT, P, P, L, P, L, L, L, INT]
    return function


def weight(out: int, k: int, quads: bool, seed: int) -> GroupedWeight:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, k), generator=generator).to(torch.int8)
    scales = (torch.rand(out, k // 32, generator=generator) * 0.01).half().float()
    mins = ((torch.rand(out, k // 32, generator=generator) - 0.5) * 0.1).half().float()
    return GroupedWeight.of(q, scales, mins, 32, 4, half=True, quads=quads)


def main(builds: list[str]) -> None:
    torch.set_num_threads(2)
    runs = {}
    for build in builds:
        name, _, rest = build.partition("=")
        path, _, layout = rest.partition(":")
        weights = [weight(o, k, layout == "quads", n) for n, (o, k) in enumerate(SHAPES * 30)]
        runs[name] = (product(path), weights)
    for rows in (1, 2, 4, 8):
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        ys = {o: torch.empty(rows, o, dtype=torch.bfloat16) for o in (960, 576, 3072)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(12):
            for name, (function, weights) in runs.items():
                started = time.perf_counter()
                for w in weights:
                    out, k = w.shape
                    assert w.mins is not None
                    function(
                        xs[k].data_ptr(), w.values.data_ptr(), 4, w.scales.data_ptr(),
                        w.mins.data_ptr(), 32, ys[out].data_ptr(), rows, k, out, 1,
                    )  # fmt: skip
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(rows, "  ".join(f"{name} {ms:.2f}" for name, ms in medians.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

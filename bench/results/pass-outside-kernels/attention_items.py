"""AVX2 attention, one kernel library against another, calls alternating in one process.

    OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python \
        bench/results/pass-outside-kernels/attention_items.py OLD/libkenspec.so NEW/libkenspec.so

Each library built from a copy of server/engine/csrc with `kernel_build.build(directory, "cc",
sources)`. SmolLM2's shapes (9 query heads, 3 kv heads, 64 dimensions), one or two tokens over
100-400 cached keys: median microseconds of 2,000 calls each, and whether both give the same
bits.
"""

import ctypes
import sys
import time

import numpy as np
import torch

P, L, INT, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


def main() -> None:
    libraries = [ctypes.CDLL(path) for path in sys.argv[1:3]]
    for library in libraries:
        function = library.kenspec_attention_avx2
        function.restype = INT
        function.argtypes = [P, P, L, L, L, L, P, P, P, L, P, INT, P, L, F]
    heads, kv_heads, dim, capacity = 9, 3, 64, 512
    for kv_length in (100, 200, 400):
        for tokens in (1, 2):
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).bfloat16()
            out = torch.empty(tokens, heads * dim, dtype=torch.bfloat16)
            keys = torch.randn(1, kv_heads, capacity, dim).bfloat16()
            values = torch.randn(1, kv_heads, capacity, dim).bfloat16()
            rows = torch.zeros(tokens, dtype=torch.int64)
            mask, mask_rows = torch.zeros(tokens, kv_length), torch.arange(tokens)
            arguments = (
                qkv.data_ptr(), out.data_ptr(), tokens, heads, kv_heads, dim, keys.data_ptr(),
                values.data_ptr(), rows.data_ptr(), capacity, mask.data_ptr(), 0,
                mask_rows.data_ptr(), kv_length, 0.125,
            )  # fmt: skip
            times: list[list[float]] = [[], []]
            for call in range(4000):
                which = call % 2
                started = time.perf_counter()
                libraries[which].kenspec_attention_avx2(*arguments)
                times[which].append(time.perf_counter() - started)
            outputs = []
            for library in libraries:
                library.kenspec_attention_avx2(*arguments)
                outputs.append(out.clone())
            old, new = (float(np.median(t)) * 1e6 for t in times)
            same = torch.equal(outputs[0], outputs[1])
            print(
                f"{tokens} token(s) over {kv_length} keys: {old:.1f} us, {new:.1f} us, same={same}"
            )


if __name__ == "__main__":
    main()

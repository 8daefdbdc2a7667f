import ctypes
import sys
import time

import torch
import torch.nn.functional as F

lib = ctypes.CDLL(sys.argv[1])
f = lib.kenspec_gemv_bf16
f.restype = None
f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
L = 30
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
W = [torch.randn(o, i).bfloat16() * 0.02 for _ in range(L) for (o, i) in shapes]


def lin(x, w):
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    f(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0])
    return y


w = torch.randn(100, 77).bfloat16()
x = torch.randn(5, 77).bfloat16()
print("tail err", (lin(x, w).float() - F.linear(x, w).float()).abs().max().item())
for M in (1, 2, 4, 7):
    x = {i: torch.randn(M, i).bfloat16() for i in (576, 1536)}

    def step():
        return [lin(x[w.shape[1]], w) for w in W]

    step()
    a = []
    for _ in range(9):
        t = time.perf_counter()
        step()
        a.append(time.perf_counter() - t)
    print(M, f"{min(a) * 1e3:.2f} ms ({212.3 / min(a) / 1e3:.1f} GB/s)")

"""The lean decoder's products alone (every layer's, in order, as a pass streams them) through
kenspec's GEMV and oneDNN, by row count and thread count: medians of 9, interleaved.

    PYTHONPATH=. python bench/results/verify-cost/products.py
"""

import statistics
import time

import torch

from server.engine.forward.cpu_kernels import load_kernels
from server.engine.forward.lean import LeanWeights
from server.engine.forward.plan import Kernel
from server.engine.target import TargetModel
from server.settings import DEFAULT_MODEL

target = TargetModel.load(DEFAULT_MODEL, device="cpu", dtype="bfloat16")
lean = LeanWeights(target.model)
kernels = load_kernels()
for product in lean.products:
    product.pack()
for threads in (1, 2):
    torch.set_num_threads(threads)
    for rows in (1, 2, 4, 8, 12, 16, 17, 32, 64, 128):
        inputs = {
            size: torch.randn(rows, size, dtype=torch.bfloat16)
            for size in {p.in_features for p in lean.products}
        }
        samples = {Kernel.GEMV: [], Kernel.PACKED: []}
        for repeat in range(10):
            for kernel in samples if repeat % 2 else reversed(samples):
                started = time.perf_counter()
                for product in lean.products:
                    product.run(inputs[product.in_features], kernel, kernels)
                samples[kernel].append(time.perf_counter() - started)
        gemv, packed = (statistics.median(samples[k][1:]) * 1000 for k in samples)
        gbs = sum(p.weight.numel() * 2 for p in lean.products) / gemv / 1e6
        print(
            f"threads {threads} rows {rows:3d}: gemv {gemv:6.2f} ms ({gbs:4.1f} GB/s)  packed {packed:6.2f} ms",
            flush=True,
        )

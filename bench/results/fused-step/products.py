"""The step's products by row count, one thread: the decoder stack (120 layers of SmolLM2's
shapes, random bf16 weights) through csrc/gemv.c's GEMV against oneDNN's packed kernel, and
the real model's output layer and int8 products through `Products.measure` (the plan's own
timing, every candidate kernel).

    taskset -c 0 python bench/results/fused-step/products.py
"""

import statistics
import time

import torch
from server.engine.fast_step import LlamaStep

from server.engine import cpu_gemv
from server.engine.target import TargetModel

torch.set_num_threads(1)
torch.manual_seed(0)
gemv = cpu_gemv.load()
assert gemv is not None, "needs avx512_bf16"
shapes = [(1728, 576), (576, 576), (3072, 576), (576, 1536)] * 30
weights = [torch.randn(out, k).bfloat16() for out, k in shapes]
packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]


def stack_seconds(rows: int, kernel: str) -> float:
    inputs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
    started = time.perf_counter()
    for weight, layout in zip(weights, packed, strict=True):
        x = inputs[weight.shape[1]]
        if kernel == "gemv":
            gemv(x, weight)
        else:
            torch.ops.mkldnn._linear_pointwise(x, layout, None, "none", [], "")
    return time.perf_counter() - started


print("decoder stack, ms (median of 7): rows gemv onednn")
for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 17, 34, 64, 136, 512):
    medians = {
        kernel: statistics.median(stack_seconds(rows, kernel) for _ in range(7)) * 1e3
        for kernel in ("gemv", "onednn")
    }
    print(rows, {kernel: round(ms, 2) for kernel, ms in medians.items()})

for weights_mode in ("bf16", "int8"):
    target = TargetModel.load(
        "models/smollm2-135m-instruct", dtype="bfloat16", weights=weights_mode
    )
    gemv8 = cpu_gemv.load_int8() if weights_mode == "int8" else None
    step = LlamaStep(target.model, gemv, gemv8, cpu_gemv.load_layer())
    for part, products in (("decoder", step.products), ("head", step.head)):
        if weights_mode == "bf16" and part == "decoder":
            continue  # (the stack above)
        timings = products.measure(rows=(1, 2, 4, 8, 12, 17, 34), repeats=5)
        print(weights_mode, part, "plan", products.plan.describe())
        for rows, by_kernel in timings.items():
            print(" ", rows, {name: round(s * 1e3, 2) for name, s in by_kernel.items()})

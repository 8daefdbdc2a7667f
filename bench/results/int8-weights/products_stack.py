"""The default model's products by kernel, bf16 weights against int8: the decoder's 210
matrices (fused as the fast step fuses them) and the output layer, each fed the same input in
order (the weights stream from memory as in a step), at 1, 7, 8 and 17 rows; medians of 9,
alternating kernels (Products.measure, as start-up does), in ms.

    PYTHONPATH=. python bench/results/int8-weights/products_stack.py > products_stack.json
"""

import json

from server.engine.fast_step import LlamaStep

from bench.machine import machine
from server.engine import cpu_gemv
from server.engine.target import TargetModel
from server.settings import DEFAULT_MODEL

ROWS = (1, 7, 8, 17)
MODES = {
    "bf16": ("bfloat16", "bf16"),
    "int8": ("bfloat16", "int8"),
    "int8-fp32": ("float32", "int8"),
}
results = {"machine": machine(), "rows": ROWS, "ms": {}}
for mode, (dtype, weights) in MODES.items():
    target = TargetModel.load(DEFAULT_MODEL, device="cpu", dtype=dtype, weights=weights)
    step = LlamaStep(target.model, cpu_gemv.load(), cpu_gemv.load_int8())
    results["ms"][mode] = {
        part: {
            rows: {kernel: round(seconds * 1000, 2) for kernel, seconds in by.items()}
            for rows, by in products.measure(ROWS, repeats=9).items()
        }
        for part, products in (("decoder", step.products), ("head", step.head))
    }
print(json.dumps(results, indent=1))

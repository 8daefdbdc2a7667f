"""Wide passes (a prompt's prefill): the default model's decoder products at 64 and 136 rows,
bf16 weights against int8 (bf16 activations), medians of 3, in ms; and the process's resident
memory after loading each.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/results/int8-weights/wide_passes.py > wide_passes.json
"""

import json
import resource

from server.engine.fast_step import LlamaStep

from server.engine import cpu_gemv
from server.engine.target import TargetModel
from server.settings import DEFAULT_MODEL

results = {"ms": {}}
for weights in ("int8", "bf16"):  # int8 first: the peak resident memory is its own
    target = TargetModel.load(DEFAULT_MODEL, device="cpu", dtype="bfloat16", weights=weights)
    step = LlamaStep(target.model, cpu_gemv.load(), cpu_gemv.load_int8())
    if weights == "int8":
        results["int8_max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    timings = step.products.measure((64, 136), repeats=3)
    results["ms"][weights] = {
        rows: {kernel: round(seconds * 1000, 1) for kernel, seconds in by.items()}
        for rows, by in timings.items()
    }
print(json.dumps(results, indent=1))

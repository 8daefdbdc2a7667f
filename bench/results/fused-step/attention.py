"""A pass's seconds (calibration.measure_pass_seconds) through the fast step at 1-65 tokens
and 128 and 1,024 positions, its attention csrc/layer.c's (every width) or SDPA's (none),
the rest as served; one thread.

    taskset -c 0 python bench/results/fused-step/attention.py
"""

import torch
from server.engine.fast_step import LlamaStep

from server.engine import cpu_gemv, fast_step
from server.engine.calibration import measure_pass_seconds
from server.engine.target import TargetModel

torch.set_num_threads(1)
target = TargetModel.load("models/smollm2-135m-instruct", dtype="bfloat16")
target.kernels = target.kernels.with_grouped({})
step = LlamaStep(target.model, cpu_gemv.load(), None, cpu_gemv.load_layer())
step.measure()
target.fast_step = step
print(step.describe())
widths = [1, 8, 17, 33, 65]
for context in (128, 1024):
    for width, name in ((1000, "layer.c attention"), (0, "SDPA")):
        fast_step.FUSED_WIDTH = width
        seconds = measure_pass_seconds(target, widths, context, 5)
        print(context, name, dict(zip(widths, (round(s * 1e3, 2) for s in seconds), strict=True)))

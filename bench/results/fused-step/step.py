"""A served pass's seconds (calibration.measure_pass_seconds) through the fast step, for 1,
7 and 17 tokens at 128 and 1,024 positions of context, one thread: the torch loop between
the products (fused 0), csrc/layer.c's kernels called layer by layer (fused 1, no whole
pass) and csrc/step.c's one-call pass (fused 2, as served).

    for f in 0 1 2; do taskset -c 0 python bench/results/fused-step/step.py $f; done
"""

import sys

import torch
from server.engine.fast_step import LlamaStep

from server.engine import cpu_gemv
from server.engine.calibration import measure_pass_seconds
from server.engine.target import TargetModel

torch.set_num_threads(1)
mode = int(sys.argv[1])
target = TargetModel.load("models/smollm2-135m-instruct", dtype="bfloat16")
target.kernels = target.kernels.with_grouped({})
step = LlamaStep(target.model, cpu_gemv.load(), None, cpu_gemv.load_layer() if mode else None)
if mode == 1:
    step._decoder = None  # the layer-by-layer loop of csrc/layer.c calls
step.measure()
target.fast_step = step
print("mode", mode, step.describe(), "| logits together:", step.together)
for context in (128, 1024):
    seconds = measure_pass_seconds(target, [1, 7, 17], context, 9)
    print(context, "positions:", [round(s * 1e3, 2) for s in seconds], "ms for 1, 7, 17 tokens")

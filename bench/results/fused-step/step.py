"""A served pass's seconds (calibration.measure_pass_seconds) through the fast step, for 1,
7 and 17 tokens at 128 and 1,024 positions of context: the torch loop between the products
(fused=0) against csrc/layer.c's kernels and csrc/step.c's one-call pass (fused=1).

    taskset -c 0 python bench/results/fused-step/step.py . 1 {0,1}
"""

import sys

import torch

torch.set_num_threads(int(sys.argv[2]))
sys.path.insert(0, sys.argv[1])
from server.engine import cpu_gemv  # noqa: E402
from server.engine.calibration import measure_pass_seconds  # noqa: E402
from server.engine.fast_step import LlamaStep  # noqa: E402
from server.engine.target import TargetModel  # noqa: E402

target = TargetModel.load(sys.argv[1] + "/models/smollm2-135m-instruct", dtype="bfloat16")
target.kernels = target.kernels.with_grouped({})
fused = cpu_gemv.load_layer() if sys.argv[3] == "1" else None
step = LlamaStep(target.model, cpu_gemv.load(), None, fused)
step.measure()
target.fast_step = step
print(step.describe(), "logits together:", step.together)
for context in (128, 1024):
    seconds = measure_pass_seconds(target, [1, 7, 17], context, 9)
    print(context, "positions:", [round(s * 1e3, 2) for s in seconds], "ms for 1, 7, 17 tokens")

import sys, torch
torch.set_num_threads(1)
from server.engine import cpu_gemv, fast_step
from server.engine.calibration import measure_pass_seconds
from server.engine.fast_step import LlamaStep
from server.engine.target import TargetModel
t = TargetModel.load("models/smollm2-135m-instruct", dtype="bfloat16")
t.kernels = t.kernels.with_grouped({})
step = LlamaStep(t.model, cpu_gemv.load(), None, cpu_gemv.load_layer())
step.measure(); t.fast_step = step
print(step.describe())
ws=[1, 8, 17, 33, 65]
for ctx in (128, 1024):
    for fw in (1000, 0):
        fast_step.FUSED_WIDTH = fw
        print(ctx, "fused attention" if fw else "sdpa", [round(x * 1e3, 2) for x in measure_pass_seconds(t, ws, ctx, 5)])

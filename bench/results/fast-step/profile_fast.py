import sys

import torch

sys.path.insert(0, sys.argv[1])
from server.engine.fast_step import LlamaStep

from server.engine import cpu_gemv
from server.engine.calibration import measure_pass_seconds
from server.engine.target import TargetModel

t = TargetModel.load(sys.argv[1] + "/models/smollm2-135m-instruct", dtype="bfloat16")
t.kernels = t.kernels.with_grouped({})
step = LlamaStep(t.model, cpu_gemv.load())
step.measure()
t.fast_step = step
print(step.describe())
ws = [1, 7]
print("fast", [round(x * 1e3, 2) for x in measure_pass_seconds(t, ws, 128, 9)])
from server.engine.fast_step import Product

orig = Product.run
Product.run = lambda self, x, k, g: torch.empty(x.shape[0], self.weight.shape[0], dtype=x.dtype)
print("no products", [round(x * 1e3, 2) for x in measure_pass_seconds(t, ws, 128, 9)])
from torch.profiler import ProfilerActivity, profile

from server.engine.verify_pass import VerifyPass

cache = t.new_cache(1)
ctx = list(range(100, 228))
t.prefill(cache, 0, 0, ctx)
with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(10):
        t.forward(cache, VerifyPass.sequences([128], [ctx[:1]]))[0][0]
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))

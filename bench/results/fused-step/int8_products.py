import sys, torch
torch.set_num_threads(1)
from server.engine import cpu_gemv
from server.engine.fast_step import LlamaStep
from server.engine.target import TargetModel
t = TargetModel.load("models/smollm2-135m-instruct", dtype="bfloat16", weights="int8")
step = LlamaStep(t.model, cpu_gemv.load(), cpu_gemv.load_int8(), cpu_gemv.load_layer())
for name, p in (("decoder", step.products), ("head", step.head)):
    tm = p.measure(rows=(1,2,4,8,17,34), repeats=3)
    for r, d in tm.items(): print(name, r, {k: round(v*1e3,2) for k,v in d.items()})

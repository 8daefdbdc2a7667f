import torch, time, statistics
torch.set_num_threads(1)
from server.engine import cpu_gemv
from server.engine.fast_step import LlamaStep
from server.engine.target import TargetModel
t = TargetModel.load("models/smollm2-135m-instruct", dtype="bfloat16")
step = LlamaStep(t.model, cpu_gemv.load(), None, cpu_gemv.load_layer())
tm = step.head.measure(rows=(1,2,4,6,8,12,17,24,34), repeats=5)
for r, d in tm.items(): print(r, {k: round(v*1e3,2) for k,v in d.items()})

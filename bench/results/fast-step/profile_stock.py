import sys

import torch

sys.path.insert(0, sys.argv[1])
from server.engine.calibration import measure_pass_seconds
from server.engine.target import TargetModel

t = TargetModel.load(sys.argv[1] + "/models/smollm2-135m-instruct", dtype="bfloat16")
torch.set_num_threads(2)
ws = [1, 2, 4, 7, 12, 17]
s = measure_pass_seconds(t, ws, 128, 7)
print({w: round(x * 1e3, 2) for w, x in zip(ws, s, strict=False)})
if len(sys.argv) > 2:
    from torch.profiler import ProfilerActivity, profile

    from server.engine.verify_pass import VerifyPass

    cache = t.new_cache(1)
    ctx = list(range(100, 228))
    t.prefill(cache, 0, 0, ctx)
    for w in (1, 7):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(5):
                t.forward(cache, VerifyPass.sequences([128], [ctx[:w]]))[0][0]
        print("width", w)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
